"""structured_outputs as data: validation at the door, canonical cache keys, the bitmask helpers,
and the engine importing and running without llguidance."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from qworker.engine.sampling_params import SamplingParams
from qworker.engine.structured import StructuredOutputError, StructuredOutputs
from qworker.engine.structured.bitmask import allowed_counts, apply_token_bitmask_, first_allowed

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"json": {"type": "object"}}, "json"),
        ({"json": '{"type": "string"}'}, "json"),
        ({"json": True}, "json"),
        ({"json": "object"}, "json"),
        ({"json_object": True}, "json"),
        ({"regex": "[a-z]+"}, "regex"),
        ({"choice": ["a", "b"]}, "choice"),
        ({"grammar": 'start: "x"'}, "grammar"),
        ({"json": {"type": "object"}, "disable_any_whitespace": True}, "json"),
    ],
)
def test_one_constraint_is_taken(value, expected):
    spec = SamplingParams(structured_outputs=value).structured_outputs
    assert isinstance(spec, StructuredOutputs) and spec.kind == expected
    assert StructuredOutputs.from_value(spec.to_dict()).cache_key == spec.cache_key


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({}, "exactly one"),
        ({"json": {}, "regex": "a"}, "got 2: json, regex"),
        ({"choice": ["a"], "grammar": "start: x"}, "got 2"),
        ({"json": {"type": "object"}, "strict": True}, "unknown field"),
        ({"guided_json": {}}, "unknown field"),
        ({"json": "{not json"}, "not JSON"),
        ({"json": 5}, "must be a JSON Schema"),
        ({"json": False}, "exactly one"),
        ({"json": "x" * (5 * 2**20)}, "limit is"),
        ({"json": "[" * 10_000 + "]" * 10_000}, "deeper than"),
        ({"regex": ""}, "non-empty"),
        ({"regex": "a" * (2**20 + 1)}, "limit is"),
        ({"choice": []}, "non-empty list"),
        ({"choice": "ab"}, "non-empty list"),
        ({"choice": ["a", 3]}, "non-empty string"),
        ({"regex": "a", "disable_any_whitespace": True}, "json only"),
        ({"json": {}, "disable_any_whitespace": "yes"}, "true or false"),
        ({"json_object": "yes"}, "must be true"),
        ("json", "must be an object"),
        ([{"json": {}}], "must be an object"),
    ],
)
def test_bad_constraints_are_refused_with_a_reason(value, message):
    with pytest.raises(StructuredOutputError, match=message):
        SamplingParams(structured_outputs=value)


def test_a_10000_level_schema_object_is_refused_without_recursing():
    deep: dict = {}
    for _ in range(10_000):
        deep = {"properties": {"a": deep}}
    with pytest.raises(StructuredOutputError, match="deeper than 128"):
        StructuredOutputs(json=deep)


def test_cache_key_ignores_key_order_and_spacing():
    a = StructuredOutputs.from_value({"json": {"type": "object", "required": ["x"]}})
    b = StructuredOutputs.from_value({"json": '{ "required" : ["x"],  "type":"object"}'})
    c = StructuredOutputs.from_value(
        {"json": {"type": "object", "required": ["x"]}, "disable_any_whitespace": True}
    )
    assert a.cache_key == b.cache_key != c.cache_key


def test_bitmask_helpers_on_odd_shapes():
    vocab = 70  # three 32-bit words, the last partly used
    bitmask = np.zeros((3, 3), dtype=np.int32)
    bitmask[0, 2] = 1 << 5  # token 69 only
    bitmask[1, 0] = 0b1010  # tokens 1 and 3
    bitmask[2, 1] = np.int32(-(2**31))  # token 63 only (the sign bit)
    assert allowed_counts(bitmask).tolist() == [1, 2, 1]
    assert first_allowed(bitmask).tolist() == [69, 1, 63]
    logits = torch.randn(5, vocab)
    original = logits.clone()
    rows = torch.tensor([0, 2, 4])
    apply_token_bitmask_(logits, rows, torch.from_numpy(bitmask))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [69]
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [1, 3]
    assert torch.isfinite(logits[4]).nonzero().flatten().tolist() == [63]
    assert torch.equal(logits[[1, 3]], original[[1, 3]])
    assert logits[0, 69] == original[0, 69]


def test_the_engine_imports_and_runs_without_llguidance():
    """The GPU check machine has torch, triton and transformers only."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["llguidance"] = None  # any import of it fails
        from qworker.config import EngineConfig
        from qworker.engine.llm_engine import LLMEngine
        from qworker.engine.sampling_params import SamplingParams
        from qworker.engine.structured import StructuredOutputError
        from qworker.testing.tiny_model import tiny_llama_model
        model = tiny_llama_model()
        config = EngineConfig(model="tiny", dtype="float32", device="cpu", num_kv_blocks=16, block_size=4)
        engine = LLMEngine(config, hf_config=model.config, state_dict=model.state_dict(), tokenizer=None)
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
        while engine.has_unfinished_requests():
            out = engine.step()
        assert out[0].finished and len(out[0].output.outputs[0].token_ids) == 4
        try:
            engine.add_request("b", [1, 2], SamplingParams(structured_outputs={"regex": "a+"}))
        except StructuredOutputError as exc:
            print("refused:", exc)
        assert "llguidance" not in [m for m in sys.modules if sys.modules[m] is not None]
        print("ok")
        """
    )
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: structured_outputs needs the model's tokenizer" in done.stdout
    assert done.stdout.strip().endswith("ok")

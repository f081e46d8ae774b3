"""The vllm-cpu bench system: spec options, the driver's environment, and the driver protocol end to
end through the real run loop, with a stand-in `vllm` package in a stand-in venv (vLLM's CPU build
itself takes minutes to start; the coordinator's benchmark runs it)."""

from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

import pytest

from qworker.bench.records import RequestStatus
from qworker.bench.registry import BenchSettings, SystemSpecError, build_system, parse_systems
from qworker.bench.run import RunLimits
from qworker.bench.run_loop import run_system, warm_up
from qworker.bench.vllm_cpu import VLLMCpuSystem, binding_env, driver_env
from qworker.bench.workload import BenchRequest

pytestmark = pytest.mark.timeout(120)

# A stand-in for the part of vLLM's API the driver uses: each step gives every running request its
# next token (prompt's last token + number of outputs so far), and a request whose prompt starts
# with 0 is refused.
FAKE_VLLM = """
import enum, types

__version__ = "0.0-fake"


class RequestOutputKind(enum.Enum):
    DELTA = 1


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos, seed, output_kind):
        self.max_tokens = max_tokens


class _Engine:
    def __init__(self):
        self.running = {}

    def add_request(self, request_id, prompt, params):
        if prompt["prompt_token_ids"][0] == 0:
            raise ValueError("prompt starts with 0")
        self.running[request_id] = [prompt["prompt_token_ids"][-1], params.max_tokens, 0]

    def abort_request(self, request_ids):
        for request_id in request_ids:
            self.running.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        outputs = []
        for request_id, state in list(self.running.items()):
            state[2] += 1
            finished = state[2] >= state[1]
            completion = types.SimpleNamespace(token_ids=[state[0] + state[2]])
            out = types.SimpleNamespace(request_id=request_id, outputs=[completion], finished=finished)
            outputs.append(out)
            if finished:
                del self.running[request_id]
        return outputs


class LLM:
    def __init__(self, model, dtype, max_model_len, seed, **options):
        self.llm_engine = _Engine()
"""


@pytest.fixture
def fake_root(tmp_path: Path) -> Path:
    """A root whose venv/bin/python is this interpreter with the stand-in vllm on its path."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM + "\nfrom vllm import inputs, sampling_params\n")
    (site / "vllm" / "inputs.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"
    )
    (site / "vllm" / "sampling_params.py").write_text("from vllm import RequestOutputKind\n")
    python = tmp_path / "root" / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return tmp_path / "root"


def requests(num: int, first_token: int = 5) -> list[BenchRequest]:
    return [BenchRequest(f"r{i}", i, [first_token, 10 * i], 3 + i, arrival_s=0.0) for i in range(num)]


def test_spec_options_build_the_system():
    system = build_system(
        parse_systems("vllm-cpu:bind=default:max_num_seqs=64:prefix_caching=on")[0], BenchSettings()
    )
    assert isinstance(system, VLLMCpuSystem)
    assert system.bind == "default"
    assert system.engine_options == {"max_num_seqs": 64, "enable_prefix_caching": True}
    assert system.dtype in ("bfloat16", "float32")
    # The one vLLM path: `vllm` names it too (the in-process system is gone).
    alias = parse_systems("vllm:block_size=32")[0]
    assert (alias.label, alias.kind, alias.options) == (
        "vllm:block_size=32",
        "vllm-cpu",
        {"block_size": "32"},
    )
    for bad in (
        "vllm-cpu:bind=fast",
        "vllm-cpu:colour=red",
        "vllm-cpu:kv_cache_gb=0",
        "vllm-cpu:block_size=x",
    ):
        with pytest.raises(SystemSpecError):
            build_system(parse_systems(bad)[0], BenchSettings())


def test_binding_and_environment(tmp_path: Path, monkeypatch):
    assert binding_env("best", 2) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert binding_env("default", 2) == {}
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env = driver_env(tmp_path, "default", 2, 4)
    assert "PYTHONPATH" not in env and "VLLM_CPU_OMP_THREADS_BIND" not in env
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["HF_HUB_OFFLINE"] == "1"
    for key in ("TMPDIR", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "HF_HOME"):
        assert Path(env[key]).parent == tmp_path and Path(env[key]).is_dir()


def test_driver_protocol_through_the_run_loop(fake_root: Path, tmp_path: Path):
    system = VLLMCpuSystem("vllm-cpu", tmp_path, "bfloat16", {}, root=fake_root, log_dir=tmp_path)
    system.prepare()
    try:
        assert system.describe()["vllm_version"] == "0.0-fake"
        assert system.describe()["vllm_env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
        warm_up(system, 2)
        batch = requests(4)
        batch.append(BenchRequest("refused", 4, [0, 1], 2, arrival_s=0.0))
        result = run_system(system, batch, keep_token_ids=True)
        by_id = {r.request_id: r for r in result.records}
        for i in range(4):
            record = by_id[f"r{i}"]
            assert record.status is RequestStatus.COMPLETED
            assert result.token_ids[f"r{i}"] == [10 * i + j for j in range(1, 4 + i)]
            assert record.num_output_tokens == 3 + i == len(record.chunk_times)
            assert 0 <= record.chunk_times[0] <= record.finish_time <= result.duration_s
        assert by_id["refused"].status is RequestStatus.FAILED
        assert "prompt starts with 0" in by_id["refused"].error
    finally:
        system.close()
    assert system._proc is None


def _state(pid: int) -> str:
    """The process's state once it is stopped, or after 10 s ("T" is stopped): a signal is
    delivered soon after kill() returns, not always before."""
    deadline = time.monotonic() + 10
    while True:
        # /proc/PID/stat: "pid (comm) state ..."
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T" or time.monotonic() > deadline:
            return state
        time.sleep(0.01)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_the_driver_is_stopped_between_its_runs(fake_root: Path, tmp_path: Path):
    """Idle vLLM polls and takes a core at times: between its runs its session is stopped, so that
    the systems measured beside it have the machine to themselves."""
    system = VLLMCpuSystem("vllm-cpu", tmp_path, "bfloat16", {}, root=fake_root, log_dir=tmp_path)
    system.prepare()
    try:
        pid = system._proc.pid
        assert _state(pid) == "T"
        warm_up(system, 1)
        assert _state(pid) == "T"
        result = run_system(system, requests(2))
        assert all(r.status is RequestStatus.COMPLETED for r in result.records)
        assert _state(pid) == "T"
    finally:
        system.close()
    assert system._proc is None


def test_timed_out_requests_are_aborted_in_the_driver(fake_root: Path, tmp_path: Path):
    system = VLLMCpuSystem("vllm-cpu", tmp_path, "bfloat16", {}, root=fake_root, log_dir=tmp_path)
    system.prepare()
    try:
        # 100 tokens each at one step per poll: far past a 0-second drain limit.
        long = [BenchRequest(f"r{i}", i, [5, 6], 100_000, arrival_s=0.0) for i in range(2)]
        result = run_system(system, long, limits=RunLimits(drain_timeout_s=0.2))
        assert all(r.status is RequestStatus.TIMEOUT for r in result.records)
        # The driver dropped them: a new run starts clean.
        again = run_system(system, requests(1))
        assert again.records[0].status is RequestStatus.COMPLETED
    finally:
        system.close()


def test_a_missing_venv_says_how_to_create_it(tmp_path: Path):
    system = VLLMCpuSystem("vllm-cpu", tmp_path, "bfloat16", {}, root=tmp_path / "nothing")
    with pytest.raises(RuntimeError, match=r"setup_vllm_cpu\.sh"):
        system.prepare()
    assert not os.path.exists(tmp_path / "nothing" / "venv")


def test_the_driver_imports_nothing_of_qworker():
    import ast

    from qworker.bench import vllm_cpu_driver

    tree = ast.parse(Path(vllm_cpu_driver.__file__).read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not {n for n in names if n.split(".")[0] not in {"json", "os", "select", "sys", "time", "vllm"}}

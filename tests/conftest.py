from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest
import torch

from qworker.testing.tiny_model import tiny_llama_model

# `make test` runs the suite in two pytest-xdist processes, one per core: each computes on one
# thread, as two torch pools of two threads each would oversubscribe the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


# -- one Redis per test process, started here; processes the suite started, checked at its end --

# The variable the processes this session starts inherit: its value names this process's session.
SESSION_ENV = "QWORKER_TEST_SESSION"


def _runs_tests(config: pytest.Config) -> bool:
    """False in pytest-xdist's controller, which only hands files to its workers."""
    return os.environ.get("PYTEST_XDIST_WORKER") is not None or not getattr(
        config.option, "numprocesses", None
    )


def pytest_configure(config: pytest.Config) -> None:
    # xdist's controller hands out whole files (--dist loadfile) in the order that
    # pytest_collection_modifyitems below sets, longest first; its default would re-sort them by
    # their number of tests, which put the long one-test files (a pool, a broker restart) last.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if not _runs_tests(config):
        return
    from qworker import envs
    from qworker.testing import worker_kit

    os.environ[SESSION_ENV] = uuid.uuid4().hex
    if envs.QWORKER_TEST_REDIS_URL.get() is None:
        # A server of this process's own on a free loopback port; subprocesses inherit its URL.
        server = worker_kit.start_private_redis()
        version = server.version()
        if version < worker_kit.MIN_TEST_REDIS_VERSION:
            server.stop()
            raise pytest.UsageError(
                f"the suite needs Redis >= {'.'.join(map(str, worker_kit.MIN_TEST_REDIS_VERSION))}; "
                f"{server.executable} is {'.'.join(map(str, version))}: install redis-server 7 "
                "(Debian: apt install redis-server), or name a server in $QWORKER_TEST_REDIS_URL"
            )
        config.stash[_REDIS_KEY] = server
        os.environ["QWORKER_TEST_REDIS_URL"] = server.url


def pytest_unconfigure(config: pytest.Config) -> None:
    server = config.stash.get(_REDIS_KEY, None)
    if server is not None:
        server.stop()


_REDIS_KEY = pytest.StashKey["object"]()


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind(request: pytest.FixtureRequest):
    """Fails the run, naming them, when processes this session started outlive it (each fixture
    that starts one must stop it, on failure and timeout too); they are killed here either way."""
    yield
    from qworker.testing.worker_kit import kill_processes_with_env, processes_with_env

    session = os.environ.get(SESSION_ENV)
    if session is None:
        return
    server = request.config.stash.get(_REDIS_KEY, None)
    ours = {server.process.pid} if server is not None and server.process is not None else set()

    def left_behind() -> dict[int, str]:
        found = processes_with_env(SESSION_ENV, session)
        return {pid: cmd for pid, cmd in found.items() if pid not in ours}

    deadline = time.monotonic() + 10  # a worker told to stop may still be draining
    while (left := left_behind()) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not left:
        return
    left = kill_processes_with_env(SESSION_ENV, session, keep=frozenset(ours))
    if not left:
        return  # they exited between the last look and the kill
    names = "; ".join(f"pid {pid}: {cmd[:200]}" for pid, cmd in sorted(left.items()))
    pytest.fail(f"the suite left {len(left)} process(es) running (now killed): {names}", pytrace=False)


# -- the order the two processes take files in: longest first --

DURATIONS_PATH = Path(__file__).with_name("durations.json")
# Seconds for a file missing from durations.json (new since it was written): a `slow` file counts
# as a long one, any other as a quick one.
NEW_SLOW_FILE_S, NEW_FILE_S = 40.0, 2.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--store-durations",
        action="store_true",
        help=f"write each file's seconds (setup, call, teardown) to {DURATIONS_PATH.name}, "
        "which orders the files of later runs",
    )


def file_seconds() -> dict[str, float]:
    try:
        table = json.loads(DURATIONS_PATH.read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in table.items()} if isinstance(table, dict) else {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files longest first (seconds from tests/durations.json), each file's tests in their order:
    the two processes take whole files in this order, so the quick files fill the end of the run
    instead of one process idling while the other finishes a long file (LPT scheduling)."""
    seconds = file_seconds()
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    root = config.rootpath

    def cost(item: pytest.Item) -> float:
        name = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else str(item.path)
        default = NEW_SLOW_FILE_S if item.path in slow_files else NEW_FILE_S
        return -seconds.get(name, default)

    items.sort(key=cost)  # stable: a file's tests keep their order, ties keep collection order


_STORED_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Under xdist this runs in the controller too, for every worker's reports.
    name = report.nodeid.split("::", 1)[0]
    _STORED_SECONDS[name] = _STORED_SECONDS.get(name, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if not config.getoption("--store-durations") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    table = {**file_seconds(), **{k: round(v, 1) for k, v in _STORED_SECONDS.items()}}
    ordered = dict(sorted(table.items(), key=lambda kv: -kv[1]))
    DURATIONS_PATH.write_text(json.dumps(ordered, indent=1) + "\n")


def tiny_hf_model(model_type: str = "llama", seed: int = 0, **overrides):
    """qworker.testing.tiny_model's tiny random model, widened, in fp32, for fast engine tests."""
    # Random init gives near-uniform logits; widened, greedy picks are not near-ties.
    return tiny_llama_model(model_type, seed=seed, widen=3.0, **overrides)


def tiny_engine(hf_model, **engine_args):
    from qworker.config import EngineConfig
    from qworker.engine.llm_engine import LLMEngine

    args = dict(model="tiny", dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)
    args.update(engine_args)
    return LLMEngine(
        EngineConfig(**args), hf_config=hf_model.config, state_dict=hf_model.state_dict(), tokenizer=None
    )


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def run_to_completion(engine) -> dict[str, object]:
    outputs = {}
    for _ in range(100_000):
        if not engine.has_unfinished_requests():
            return outputs
        for step_output in engine.step():
            if step_output.finished:
                outputs[step_output.request_id] = step_output.output
    raise AssertionError("engine did not finish")


def run_with_staggered_arrivals(
    engine, prompts: list[list[int]], params, steps_between: int
) -> list[list[int]]:
    """Add one prompt, run `steps_between` steps, add the next, ... then run to the end: requests
    join while others decode. Returns each prompt's output token ids, in prompt order."""
    outputs: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        for _ in range(steps_between):
            for step_output in engine.step():
                if step_output.finished:
                    outputs[step_output.request_id] = step_output.output.outputs[0].token_ids
    return [outputs[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_hf_model("llama")

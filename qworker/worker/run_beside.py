"""One process as worker and client at once (the demo, benchmarks): the worker on the main thread,
a task beside it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Worker(Protocol):
    """What run_beside needs of a loop.Worker."""

    name: str

    def run(self) -> object: ...

    def stop(self) -> None: ...


def run_beside(worker: Worker, task: Callable[[], T]) -> T:
    """Serve with `worker` on this thread while `task` runs in another; stop the worker (a drain)
    when the task ends, then return the task's value or raise its exception here.

    For a process that is both worker and client (the demo, benchmarks): the worker, so the
    engine, keeps the main thread, because torch's CPU thread pool runs the same matmuls 1.3-1.7x
    slower when a second Python thread drives it; the task should only do I/O.
    """
    outcome: dict[str, Any] = {}

    def side() -> None:
        try:
            outcome["value"] = task()
        except BaseException as exc:  # re-raised on the calling thread
            outcome["error"] = exc
        finally:
            worker.stop()

    thread = threading.Thread(target=side, name=f"{worker.name}-beside", daemon=True)
    thread.start()
    worker.run()
    # The worker stops when the task ends, but also on a signal: then the task is given a while.
    thread.join(timeout=60)
    if thread.is_alive():
        raise RuntimeError("the worker stopped while its side task was still running")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]

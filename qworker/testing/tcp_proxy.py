"""A loopback TCP proxy that can cut its endpoint and bring it back, for outage tests.

A restarted moto or RabbitMQ node would lose (or take long to restore) its queues; a proxy in front
of one long-lived server makes the same outage a client sees with the server's state kept:
`cut()` closes the listening socket (new connections are refused, as by a stopped server) and every
live connection (a call in flight is cut off mid-request), and `resume()` listens again on the
same port.
"""

from __future__ import annotations

import contextlib
import socket
import threading

_CHUNK_BYTES = 65536


class CuttableProxy:
    def __init__(self, upstream_port: int, *, host: str = "127.0.0.1") -> None:
        self.host = host
        self.upstream_port = upstream_port
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.port = self._listen(0)
        self.num_cuts = 0
        self.num_connections = 0

    @property
    def is_cut(self) -> bool:
        return self._listener is None

    def _listen(self, port: int) -> int:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # The same port again right after a cut, although the cut connections sit in TIME_WAIT.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, port))
        listener.listen(128)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True, name="proxy-accept").start()
        return int(listener.getsockname()[1])

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener was closed: a cut or close()
            try:
                upstream = socket.create_connection((self.host, self.upstream_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # cut while connecting
                    client.close()
                    upstream.close()
                    return
                self._sockets |= {client, upstream}
                self.num_connections += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True, name="proxy-pump").start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(_CHUNK_BYTES):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()

    def cut(self) -> None:
        """Refuse new connections and close the live ones."""
        with self._lock:
            listener, self._listener = self._listener, None
            live, self._sockets = self._sockets, set()
            self.num_cuts += 1
        if listener is not None:
            listener.close()
        for sock in live:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def resume(self) -> None:
        """Listen again on the same port."""
        assert self._listener is None, "resume() after cut()"
        self._listen(self.port)

    def close(self) -> None:
        self.cut()

    def __enter__(self) -> CuttableProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

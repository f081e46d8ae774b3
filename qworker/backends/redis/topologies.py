"""Private Redis topologies on loopback ports, for tests, the chaos soak and the queue bench: a
3-primary Redis Cluster (`redis-server --cluster-enabled yes`, then `redis-cli --cluster create`)
and a primary with one replica and three sentinels. No persistence (a cluster node or a primary
that dies stays dead unless restarted; replication is what keeps the data). Each process is one
this module started, stopped by its own handle.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from qworker.backends.redis.server import free_port


def free_cluster_port() -> int:
    """A free port whose cluster bus port (10,000 higher) is free too; both at most 65535."""
    import random
    import socket

    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20_000, 55_000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10_000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


def _wait_ping(port: int, process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    import redis

    client = redis.Redis(port=port, socket_connect_timeout=0.5)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                client.ping()
                return
            except redis.RedisError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis on port {port} did not start") from None
                time.sleep(0.05)
    finally:
        client.close()


def _stop(process: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


class RedisNode:
    """One redis-server process (a cluster node, a primary, a replica or a sentinel)."""

    def __init__(self, data_dir: Path, args: list[str], *, port: int | None = None) -> None:
        if shutil.which("redis-server") is None:
            raise FileNotFoundError("redis-server is not on PATH")
        self.port = port or free_port()
        self.data_dir = data_dir
        self.args = args
        self.process: subprocess.Popen[bytes] | None = None
        data_dir.mkdir(parents=True, exist_ok=True)

    def start(self) -> RedisNode:
        head = self.args[:1] if self.args[:1] and not self.args[0].startswith("--") else []
        rest = self.args[len(head) :]
        argv = ["redis-server", *head, "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--dir", str(self.data_dir), "--save", "", "--appendonly", "no", *rest]
        log = open(self.data_dir / "redis.log", "ab")  # noqa: SIM115 - the process owns it
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        _wait_ping(self.port, self.process)
        return self

    def kill(self) -> None:
        """SIGKILL: a crash."""
        _stop(self.process, signal.SIGKILL)
        self.process = None

    def stop(self) -> None:
        _stop(self.process)
        self.process = None

    def client(self, **kwargs: Any) -> Any:
        import redis

        return redis.Redis(port=self.port, socket_timeout=10, **kwargs)


class LocalCluster:
    """A Redis Cluster of `num_primaries` primaries and no replicas on loopback ports."""

    def __init__(self, data_dir: Path, num_primaries: int = 3) -> None:
        dirs = [data_dir / f"node{i}" for i in range(num_primaries)]
        self.nodes = [
            RedisNode(
                d,
                ["--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf")],
                port=free_cluster_port(),
            )
            for d in dirs
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes) + "/0"

    def start(self, timeout_s: float = 60.0) -> LocalCluster:
        for node in self.nodes:
            node.start()
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=timeout_s,
        )
        deadline = time.monotonic() + timeout_s
        while any(n.client().cluster("info")["cluster_state"] != "ok" for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def node_id(self, node: RedisNode) -> str:
        return str(node.client(decode_responses=True).execute_command("CLUSTER", "MYID"))

    def owner_of(self, slot: int) -> RedisNode:
        by_port = {node.port: node for node in self.nodes}
        # Every node's view, so that a move counts only once all of them know it.
        owners = set()
        for node in self.nodes:
            for start, end, primary, *_ in node.client().execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    owners.add(int(primary[1]))
        if len(owners) != 1:
            raise LookupError(f"the nodes disagree on slot {slot}'s owner: ports {sorted(owners)}")
        return by_port[owners.pop()]

    def migrate_slot(self, slot: int, target: RedisNode, *, batch: int = 10, pause_s: float = 0.0) -> int:
        """Move `slot` to `target` as `redis-cli --cluster reshard` does (IMPORTING, MIGRATING,
        MIGRATE of its keys a batch at a time, SETSLOT NODE everywhere), `pause_s` between
        batches so that clients meet the slot half moved (ASK). Returns the keys moved."""
        source = self.owner_of(slot)
        if source is target:
            return 0
        src, dst = source.client(decode_responses=True), target.client(decode_responses=True)
        src_id, dst_id = self.node_id(source), self.node_id(target)
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        moved = 0
        while True:
            names = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch)
            if not names:
                break
            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 10_000, "KEYS", *names)
            moved += len(names)
            time.sleep(pause_s)
        for node in (target, source, *(n for n in self.nodes if n not in (source, target))):
            node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        return moved


class LocalSentinels:
    """A primary, one replica and three sentinels watching them as service `service`."""

    def __init__(self, data_dir: Path, service: str = "qwprimary", *, down_after_ms: int = 1000) -> None:
        self.service = service
        self.data_dir = data_dir
        self.primary = RedisNode(data_dir / "primary", [])
        self.replica = RedisNode(data_dir / "replica", ["--replicaof", "127.0.0.1", str(self.primary.port)])
        self.down_after_ms = down_after_ms
        self.sentinels: list[RedisNode] = []
        for i in range(3):
            config = data_dir / f"sentinel{i}" / "sentinel.conf"
            config.parent.mkdir(parents=True, exist_ok=True)
            self.sentinels.append(RedisNode(config.parent, [str(config), "--sentinel"]))

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def start(self, timeout_s: float = 60.0) -> LocalSentinels:
        self.primary.start()
        self.replica.start()
        for sentinel in self.sentinels:
            (sentinel.data_dir / "sentinel.conf").write_text(
                f"sentinel monitor {self.service} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.service} 10000\n"
                f"sentinel parallel-syncs {self.service} 1\n"
            )
            sentinel.start()
        deadline = time.monotonic() + timeout_s
        while not self._is_settled():
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinels did not see the replica and each other")
            time.sleep(0.2)
        return self

    def _is_settled(self) -> bool:
        import redis

        try:
            for sentinel in self.sentinels:
                info = sentinel.client().sentinel_master(self.service)
                if int(info.get("num-slaves", 0)) < 1 or int(info.get("num-other-sentinels", 0)) < 2:
                    return False
            replication = self.replica.client().info("replication")
            return replication.get("master_link_status") == "up"
        except redis.RedisError:
            return False

    def primary_port(self) -> int:
        _, port = self.sentinels[0].client().sentinel_get_master_addr_by_name(self.service)
        return int(port)

    def stop(self) -> None:
        for node in (*self.sentinels, self.replica, self.primary):
            node.stop()

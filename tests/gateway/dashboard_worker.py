"""A fake-engine worker process for the dashboard's tests: the real worker loop, the real Redis
queue and result store, the scripted FakeEngine (no model, no torch), its /metrics on a port.

    python tests/gateway/dashboard_worker.py URL NAME STATS_INTERVAL_S METRICS_PORT

Each engine step sleeps 20 ms, so that a job of a few dozen tokens holds KV blocks for a while.
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    url, name, interval, port = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    from qworker.backends.connections import open_sink, open_source
    from qworker.config import EngineConfig
    from qworker.health import HealthServer, HealthState
    from qworker.startup import HardwareInfo
    from qworker.testing.fake_engine import FakeEngine
    from qworker.worker.loop import Worker
    from qworker.worker.metrics import WorkerMetrics
    from qworker.worker.settings import WorkerSettings

    config = EngineConfig(model="fake-tiny", block_size=4, num_kv_blocks=64, max_num_seqs=8)
    engine = FakeEngine(config)
    engine.on_step = lambda n: time.sleep(0.02)
    metrics, health = WorkerMetrics(), HealthState()
    server = HealthServer(metrics.registry, health, host="127.0.0.1", port=port).start()
    source = open_source(url, consumer=name, lease_timeout_s=5)
    sink = open_sink(url)  # results on the queue's server, under the URL's prefix
    settings = WorkerSettings(name=name, stats_interval_s=interval, poll_interval_s=0.2)
    worker = Worker(engine, source, sink, settings, metrics=metrics, health=health)
    hardware = HardwareInfo(
        device="cpu",
        device_name="fake CPU",
        device_memory_bytes=2**30,
        dtype="float32",
        num_kv_blocks=64,
        block_size=4,
        kv_capacity_tokens=256,
    )
    worker.stats.hardware = hardware
    metrics.set_info(model=config.model, dtype="float32", device="cpu")
    metrics.set_hardware(hardware)
    worker.install_signal_handlers()
    print(f"qworker worker {name} ready", flush=True)
    worker.run()
    source.close()
    sink.close()
    server.close()


if __name__ == "__main__":
    main()

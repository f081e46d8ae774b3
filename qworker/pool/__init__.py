"""Pool sizing: the KV demand of the waiting and running work (demand.py, pure arithmetic that
every backend's backlog reader uses) and the exporter that publishes it as Prometheus gauges for
KEDA (exporter.py). May import `qworker.backends` and `qworker.health`; never the worker loop or
the engine.
"""

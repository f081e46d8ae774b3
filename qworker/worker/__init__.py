"""The worker: the step loop (loop.py) and what only the loop uses. A leased message enters through
intake.py (pure), is carried out by take.py, runs in the engine through `EngineProtocol`
(engine_protocol.py), and leaves through finish.py and the outbox. Admission, leases, broker-call
retry, metrics and the worker's settings live beside it.

May import `qworker.jobs`, `qworker.backends`, `qworker.health`, `qworker.engine` (through the
protocol; the concrete engine is built by the CLI) and `qworker.config`; never the gateway or batch.
"""

"""What tests, scripts and the GPU check build on, shipped so that they share one copy: the tiny
random Llama (tiny_model.py: torch and transformers, no worker libraries), a model-free engine
that satisfies the worker's `EngineProtocol` (fake_engine.py), and the worker test kit (worker_kit.py:
the suite's Redis, unique URLs, a worker subprocess). Nothing in the package imports this one.
"""

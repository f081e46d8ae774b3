"""`qworker batch`: run an OpenAI batch file (`vllm run-batch`'s format) locally or across the pool.

command.py (the command), local.py (rows on an engine in this process), invariance.py (a local run
is batch-invariant). The file format, row parsing, bodies and the pool runner are the OpenAI
protocol's (`qworker.openai`), which the gateway shares; this package imports it and the engine,
never the gateway.
"""

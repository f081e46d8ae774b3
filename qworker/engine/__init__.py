"""The engine: requests, KV blocks and the prefix cache, the scheduler, the model runner, the
sampler, structured output, and `LLMEngine`/`LLM` on top. Imports torch, triton, transformers,
`qworker.model` and `qworker_kernels`; never pydantic, redis, boto3 or anything of the worker
(tests/unit/test_layering.py checks it in a fresh interpreter).
"""

"""One router per concern: generation (chat, completions), models, vLLM's tokenizer routes and the
probes. app.py mounts them with the Files, Batches and async-jobs routers of `gateway.async_api`."""

"""The HTTP front of a qworker pool: OpenAI's routes, vLLM's tokenizer routes, probes and metrics.

A producer and a reader of the result store, nothing more: it imports neither torch nor
transformers (tests/gateway/test_layering_gateway.py checks it). `qworker gateway` serves it;
`create_app` builds it for tests and embedding.
"""

from __future__ import annotations

from qworker.gateway.settings import GatewaySettings

__all__ = ["GatewaySettings"]

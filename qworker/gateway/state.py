"""What every route reads: the settings, the pool, the tokenizer, the gate and the metrics, kept on
`app.state.gateway` (one per app, so tests can run several apps in one process)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from fastapi import Request

from qworker.gateway.backpressure import DemandGate
from qworker.gateway.errors import GatewayError
from qworker.gateway.metrics import GatewayMetrics
from qworker.gateway.pool import Pool
from qworker.gateway.settings import GatewaySettings
from qworker.gateway.tokenizer import GatewayTokenizer, TokenizerNotFoundError

logger = logging.getLogger(__name__)


@dataclass
class GatewayState:
    settings: GatewaySettings
    pool: Pool
    gate: DemandGate
    metrics: GatewayMetrics
    _tokenizer: GatewayTokenizer | None = None
    _tokenizer_problem: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def tokenizer(self) -> GatewayTokenizer | None:
        """The tokenizer, loaded on first use and retried until found: a gateway starts before any
        worker has converted the model (scale from zero); until then token counts are estimates."""
        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = GatewayTokenizer.load(
                        self.settings.model, self.settings.tokenizer, self.settings.max_model_len
                    )
                    self._tokenizer_problem = None
                except TokenizerNotFoundError as exc:
                    if self._tokenizer_problem != str(exc):
                        logger.warning("no tokenizer yet: %s", exc)
                    self._tokenizer_problem = str(exc)
            return self._tokenizer

    def require_tokenizer(self) -> GatewayTokenizer:
        tokenizer = self.tokenizer()
        if tokenizer is None:
            raise GatewayError(
                503, f"the gateway has no tokenizer: {self._tokenizer_problem}", code="no_tokenizer"
            )
        return tokenizer


def gateway_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


def check_model(state: GatewayState, model: object) -> None:
    """404 for a model this gateway does not serve (None: the default)."""
    served = state.settings.served_model_names
    if model is not None and model not in served:
        raise GatewayError(
            404,
            f"the model {model!r} does not exist; this gateway serves {', '.join(map(repr, served))}",
            code="model_not_found",
            param="model",
        )

"""The gateway is a producer and a reader of the result store: importing it, building its app and
its command pull in neither torch nor transformers (its image installs neither)."""

from __future__ import annotations

import pytest

from tests.unit.test_layering import ENGINE_LIBRARIES, imported_in_turn


@pytest.mark.timeout(150)
def test_gateway_imports_no_torch():
    modules = [
        "qworker.gateway",
        "qworker.gateway.app",
        "qworker.gateway.command",
        "qworker.gateway.http_protocol",
        "qworker.gateway.generation",
        "qworker.gateway.tokenizer",
        "qworker.gateway.routes.tokenize",
    ]
    [loaded] = imported_in_turn([(modules, ENGINE_LIBRARIES)])
    assert loaded == [], f"the gateway pulled in {loaded}: its image has no torch"

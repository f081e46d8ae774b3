"""vLLM's POST /tokenize, POST /detokenize and GET /tokenizer_info (lm-evaluation-harness's remote
tokenizer backend reads these, so it needs no tokenizer of its own)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from qworker.gateway.errors import GatewayError
from qworker.gateway.state import check_model, gateway_state
from qworker.gateway.tokenizer import ChatTemplateError
from qworker.openai.format import RowError
from qworker.openai.request_models import DetokenizeRequest, TokenizeRequest
from qworker.openai.rows import parse_messages

router = APIRouter(tags=["tokenizer"])
# A prompt to tokenize is bounded as a job's is (qworker.jobs.job.MAX_PROMPT_CHARS).
MAX_TOKENIZE_CHARS = 1_000_000


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = gateway_state(request)
    check_model(state, body.model)
    tokenizer = state.require_tokenizer()
    if (body.prompt is None) == (body.messages is None):
        raise GatewayError(400, "give exactly one of prompt and messages")
    if body.messages is not None:
        try:
            messages = parse_messages([m.model_dump(exclude_unset=True) for m in body.messages])
        except RowError as exc:
            raise GatewayError.from_row_error(exc) from None
        try:
            text = tokenizer.render_chat(messages, body.add_generation_prompt)
        except ChatTemplateError as exc:
            raise GatewayError(400, str(exc), param="messages") from None
        add_special_tokens = False  # the template wrote them
    else:
        assert body.prompt is not None
        text, add_special_tokens = body.prompt, body.add_special_tokens
    if len(text) > MAX_TOKENIZE_CHARS:
        raise GatewayError(
            400, f"the text is {len(text)} characters; the limit is {MAX_TOKENIZE_CHARS}", param="prompt"
        )
    tokens = await state.pool.call(tokenizer.encode, text, add_special_tokens)
    return {
        "count": len(tokens),
        "max_model_len": tokenizer.max_model_len,
        "tokens": tokens,
        "token_strs": tokenizer.token_strs(tokens) if body.return_token_strs else None,
    }


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state = gateway_state(request)
    check_model(state, body.model)
    tokenizer = state.require_tokenizer()
    outside = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
    if outside:
        raise GatewayError(
            400,
            f"token ids {outside[:5]} are outside the vocabulary [0, {tokenizer.vocab_size})",
            param="tokens",
        )
    return {"prompt": tokenizer.decode(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    return gateway_state(request).require_tokenizer().info()

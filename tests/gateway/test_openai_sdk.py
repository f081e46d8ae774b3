"""The official openai SDK, unchanged, against a gateway and one real worker (SmolLM2, fp32, one
thread) on the real Redis. One worker and one gateway serve the whole module."""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import openai
import pytest
import redis

from qworker.gateway.app import create_app
from qworker.gateway.settings import GatewaySettings
from qworker.openai.rows import request_id_for
from qworker.testing.worker_kit import cleanup, redis_base_url, spawn_worker, unique_url
from tests.gateway.conftest import API_KEY, metric_value, serve_app

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def wait_until(predicate, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


def queued_entries(url: str) -> int:
    """Entries ever added to the queue's streams (both priority lanes)."""
    r = redis.Redis.from_url(redis_base_url())
    stream = url.split("stream=")[1].split("&")[0]
    return sum(r.xlen(name) for name in (stream, f"{stream}:high"))


def kv_blocks(worker_metrics_url: str) -> tuple[float, float]:
    """(free, total) KV blocks on the worker's /metrics."""
    text = httpx.get(worker_metrics_url).text
    return (
        metric_value(text, "qworker_kv_cache_free_blocks"),
        metric_value(text, "qworker_kv_cache_total_blocks"),
    )


def job_id_of(response_id: str, index: int = 0) -> str:
    """The job behind choice `index`'s prompt: rows.request_id_for(request id, prompt index)."""
    return request_id_for(response_id.split("-", 1)[1], str(index))


@pytest.mark.timeout(240)
def test_scale_from_zero_a_request_waits_for_the_first_worker(tmp_path):
    """A gateway on a queue no worker serves; a request sent now waits, and completes once the
    pool's first worker starts. Its own queue, gateway and worker: the suite's shared worker may
    be up already, whichever module ran first."""
    url = unique_url(redis_base_url(), "gateway-zero")
    app = create_app(GatewaySettings(request_timeout_s=200), queue=url, api_keys=frozenset({API_KEY}))
    worker = None
    try:
        with serve_app(app) as served:
            sdk = openai.OpenAI(base_url=served.base_url, api_key=API_KEY, max_retries=0, timeout=210)
            outcome: dict[str, object] = {}

            def ask() -> None:
                try:
                    outcome["response"] = sdk.chat.completions.create(
                        model="smollm2", messages=CHAT, max_tokens=4
                    )
                except Exception as exc:
                    outcome["error"] = exc

            asking = threading.Thread(target=ask)
            asking.start()
            # The request's job is on the queue, and the request still waits: no worker runs.
            wait_until(lambda: queued_entries(url) >= 1, "the request's job on the queue", timeout_s=60)
            assert asking.is_alive() and not outcome, outcome
            worker = spawn_worker(url, "smollm2", "gw-zero", log_path=tmp_path / "worker.log")
            asking.join(timeout=200)
            assert not asking.is_alive() and "error" not in outcome, outcome
            response = outcome["response"]
            assert response.choices[0].finish_reason in ("stop", "length")  # type: ignore[attr-defined]
    finally:
        if worker is not None:
            worker.kill()
            worker.wait(timeout=60)
        cleanup(redis.Redis.from_url(redis_base_url()), url)


@pytest.mark.timeout(120)
def test_chat_without_streaming(sdk, store, worker):
    response = sdk.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=12, temperature=0)
    assert response.object == "chat.completion"
    [choice] = response.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    stored = store.result(job_id_of(response.id), timeout=5)
    assert choice.message.content == stored.text
    assert response.usage.completion_tokens == len(stored.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


@pytest.mark.timeout(120)
def test_chat_streaming_equals_the_stored_result(sdk, store):
    chunks = list(
        sdk.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Write a short sentence about the sea."}],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])
    # include_usage: a last chunk without choices carries the usage; every other has usage null.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 2, "streamed in pieces"
    stored = store.result(job_id_of(chunks[0].id), timeout=5)
    assert text == stored.text and text


@pytest.mark.timeout(120)
def test_usage_counts_the_prompt_tokens_the_worker_found_in_its_prefix_cache(sdk, store, worker):
    """usage.prompt_tokens_details.cached_tokens, as OpenAI reports it: the whole KV blocks (16
    tokens each on the worker) of the prompt that the worker's prefix cache held."""
    # A prompt no earlier request began with, of several blocks.
    text = f"Note {uuid.uuid4().hex}: " + "the quick brown fox jumps over the lazy dog, " * 5

    def full_blocks(num_tokens: int) -> int:  # below the last token, which is always computed
        return (num_tokens - 1) // 16 * 16

    # Two copies in one completions body, one job each: one computes the prompt, the other takes
    # its blocks; the usage is summed over the prompts.
    both = sdk.completions.create(model="smollm2", prompt=[text, text], max_tokens=1, temperature=0)
    num_prompt = both.usage.prompt_tokens // 2
    assert full_blocks(num_prompt) >= 48
    assert both.usage.prompt_tokens_details.cached_tokens == full_blocks(num_prompt)
    # Chat: the first request finds at most the chat template's opening (every chat begins
    # with it), not its own message; the same one streamed finds all its whole blocks, in the
    # include_usage chunk.
    messages = [{"role": "user", "content": text}]
    first = sdk.chat.completions.create(model="smollm2", messages=messages, max_tokens=1, temperature=0)
    chunks = list(
        sdk.chat.completions.create(
            model="smollm2",
            messages=messages,
            max_tokens=1,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage.prompt_tokens == first.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens == full_blocks(usage.prompt_tokens)
    assert first.usage.prompt_tokens_details.cached_tokens < full_blocks(usage.prompt_tokens)
    # The stored job results carry it too.
    stored = store.result(job_id_of(first.id), timeout=5)
    assert stored.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens_details.cached_tokens


@pytest.mark.timeout(120)
def test_completions_with_a_token_id_prompt(sdk, gateway):
    tokens = httpx.post(
        f"{gateway.url}/tokenize",
        json={"prompt": "Once upon a time"},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()["tokens"]
    by_ids = sdk.completions.create(model="smollm2", prompt=tokens, max_tokens=8, temperature=0)
    by_text = sdk.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert by_ids.object == "text_completion"
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.choices[0].text
    assert by_ids.usage.prompt_tokens == len(tokens)


@pytest.mark.timeout(120)
def test_completions_echo_with_logprobs(sdk):
    prompt = "The capital of France is"
    response = sdk.completions.create(
        model="smollm2", prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2
    )
    [choice] = response.choices
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    lp = choice.logprobs
    num_prompt = response.usage.prompt_tokens
    assert (
        len(lp.tokens)
        == num_prompt + 1
        == len(lp.token_logprobs)
        == len(lp.top_logprobs)
        == len(lp.text_offset)
    )
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    # Greedy: the generated token is the most likely one at its place.
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()))


@pytest.mark.timeout(120)
def test_n_and_several_prompts_are_indexed_as_openai_does(sdk):
    response = sdk.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=6, temperature=0.9, seed=7, n=3
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.message.content is not None for c in response.choices)
    several = sdk.completions.create(
        model="smollm2", prompt=["Hello", "The sky is"], max_tokens=4, temperature=0, n=2
    )
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    # Greedy: both completions of one prompt agree; choices 0-1 are prompt 0's, 2-3 prompt 1's.
    texts = [c.text for c in several.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]
    single = sdk.completions.create(model="smollm2", prompt="The sky is", max_tokens=4, temperature=0)
    assert texts[2] == single.choices[0].text


@pytest.mark.timeout(120)
def test_penalties_and_biases_reach_the_worker(sdk, gateway, worker):
    def text_of(tokens: list[int]) -> str:
        body = {"tokens": tokens}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        return httpx.post(f"{gateway.url}/detokenize", json=body, headers=headers).json()["prompt"]

    forced = sdk.completions.create(
        model="smollm2",
        prompt="Hello",
        max_tokens=4,
        temperature=0,
        logit_bias={"77": 100},
        frequency_penalty=0.5,
    )
    assert forced.choices[0].text == text_of([77] * 4)
    allowed = sdk.chat.completions.create(
        model="smollm2",
        messages=CHAT,
        max_tokens=3,
        temperature=0.8,
        seed=3,
        presence_penalty=-1,
        extra_body={"allowed_token_ids": [77, 78], "repetition_penalty": 1.2, "ignore_eos": True},
    )
    assert allowed.choices[0].message.content in {
        text_of([a, b, c]) for a in (77, 78) for b in (77, 78) for c in (77, 78)
    }
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model="smollm2", messages=CHAT, presence_penalty=2.5)
    assert bad.value.body["param"] == "presence_penalty"
    with pytest.raises(openai.BadRequestError) as outside:
        sdk.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2, logit_bias={"10000000": 1})
    assert "logit_bias" in str(outside.value)
    # A prompt past the context runs truncated to its last k tokens, as the same k tokens alone do.
    prompt = [1] * 9000 + [504, 1142, 282]
    truncated = sdk.completions.create(
        model="smollm2", prompt=prompt, max_tokens=3, temperature=0, extra_body={"truncate_prompt_tokens": 3}
    )
    alone = sdk.completions.create(model="smollm2", prompt=prompt[-3:], max_tokens=3, temperature=0)
    assert truncated.choices[0].text == alone.choices[0].text


@pytest.mark.timeout(60)
def test_models_list(sdk):
    assert [m.id for m in sdk.models.list()] == ["smollm2"]
    assert sdk.models.retrieve("smollm2").id == "smollm2"


@pytest.mark.timeout(60)
def test_errors_arrive_as_the_sdks_exception_types(sdk, gateway):
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model="smollm2", messages=CHAT, n=10**9)
    with pytest.raises(openai.BadRequestError) as too_long:
        sdk.completions.create(model="smollm2", prompt=[1] * 9000, max_tokens=4)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="no-such-model", messages=CHAT)
    wrong = openai.OpenAI(base_url=gateway.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(f"{gateway.url}/v1/models").status_code == 401
    assert httpx.get(f"{gateway.url}/healthz").status_code == 200
    assert httpx.get(f"{gateway.url}/readyz").status_code == 200


@pytest.mark.timeout(120)
def test_disconnect_mid_stream_cancels_the_job_and_frees_its_blocks(sdk, store, worker):
    stream = sdk.completions.create(
        model="smollm2",
        prompt="Count from one to a thousand: one, two, three,",
        max_tokens=2000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].text)
        if seen >= 3:
            break
    job_id = job_id_of(chunk.id)
    # 2,000 tokens: the job runs far longer than the gauges take to show its blocks.
    wait_until(lambda: kv_blocks(worker)[0] < kv_blocks(worker)[1], "the job's blocks in use", timeout_s=30)
    stream.close()
    # A cancelled result, not one of 2,000 tokens: the disconnect stopped the job.
    result = store.result(job_id, timeout=60)
    assert result.status.value == "cancelled" and result.usage.completion_tokens < 2000, result
    free_all = lambda: kv_blocks(worker)[0] == kv_blocks(worker)[1]
    wait_until(free_all, "the cancelled job's blocks freed", timeout_s=30)


@pytest.mark.timeout(120)
def test_a_client_that_stops_waiting_gets_its_job_cancelled(gateway, worker):
    """Without streaming: the client gives up (its read timeout) while the job runs."""
    auth = {"Authorization": f"Bearer {API_KEY}"}

    def gateway_metric(name: str) -> float:
        return metric_value(httpx.get(f"{gateway.url}/metrics", headers=auth).text, name) or 0.0

    cancelled = 'qworker_gateway_cancelled_jobs_total{reason="disconnect"}'
    worker_cancelled = 'qworker_jobs_total{status="cancelled"}'

    def worker_metric(name: str) -> float:
        return metric_value(httpx.get(worker).text, name) or 0.0

    before, worker_before = gateway_metric(cancelled), worker_metric(worker_cancelled)
    body = {"model": "smollm2", "prompt": "Count: one, two,", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.url}/v1/completions", json=body, headers=auth, timeout=2.0)
    wait_until(lambda: gateway_metric(cancelled) >= before + 1, "the gateway to cancel the job", 30)
    # The worker ends the job as cancelled (not at its 2,000 tokens) and frees its blocks.
    wait_until(lambda: worker_metric(worker_cancelled) >= worker_before + 1, "a cancelled result", 60)
    wait_until(lambda: kv_blocks(worker)[0] == kv_blocks(worker)[1], "the job's blocks freed", 30)


@pytest.mark.timeout(90)
def test_no_worker_scale_from_zero_timeout_and_backpressure(tmp_path):
    """A second pool with no worker: a request waits; one whose timeout passes gets 504 and its
    job is cancelled; a worker started later serves a waiting request; a saturated queue gets 429."""
    url = unique_url(redis_base_url(), "gateway-zero")
    r = redis.Redis.from_url(redis_base_url())
    settings = GatewaySettings(request_timeout_s=2.0, max_waiting_blocks=40, demand_interval_s=0.2)
    app = create_app(settings, queue=url)
    try:
        with serve_app(app) as served:
            sdk = openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=60)
            started = time.monotonic()
            with pytest.raises(openai.InternalServerError) as timed_out:
                sdk.completions.create(
                    model="smollm2", prompt="Hello", max_tokens=4, extra_body={"priority": -3}
                )
            assert timed_out.value.status_code == 504 and time.monotonic() - started >= 2.0
            # The request's priority is its job's (the queue orders on it).
            stream = url.split("stream=")[1].split("&")[0]
            entries = [*r.xrange(stream), *r.xrange(f"{stream}:high")]
            bodies = [json.loads(v) for _, fields in entries for v in fields.values() if v.startswith(b"{")]
            assert [(b["prompt"], b["priority"], b["ttl_s"]) for b in bodies] == [("Hello", -3, 2.0)]
            cancelled = {k.decode() for k in r.scan_iter(match=f"{url.split('prefix=')[1]}*cancel*")}
            assert cancelled, "the timed-out job was cancelled"
            # That job still waits in the queue (no worker): 1 block. A request that would take the
            # waiting demand past the bound of 40 blocks is refused with 429 and Retry-After,
            # once the gate's reading of the queue (every 0.2 s) has seen it.
            gate = app.state.gateway.gate
            wait_until(lambda: (gate.waiting_blocks or 0) >= 1, "a reading with the waiting job", 30)
            with pytest.raises(openai.RateLimitError) as limited:
                sdk.completions.create(model="smollm2", prompt="Hello " * 200, max_tokens=500)
            assert limited.value.response.headers["Retry-After"] == "2"
    finally:
        cleanup(r, url)


@pytest.mark.timeout(60)
def test_tokenizer_routes_in_vllms_shapes(gateway, worker):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    text = httpx.post(
        f"{gateway.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}, headers=auth
    ).json()
    assert text["count"] == len(text["tokens"]) == len(text["token_strs"]) and text["max_model_len"] == 8192
    assert "".join(text["token_strs"]).replace("Ġ", " ") == "Hello world"
    back = httpx.post(f"{gateway.url}/detokenize", json={"tokens": text["tokens"]}, headers=auth).json()
    assert back == {"prompt": "Hello world"}
    chat = httpx.post(f"{gateway.url}/tokenize", json={"messages": CHAT}, headers=auth).json()
    info = httpx.get(f"{gateway.url}/tokenizer_info", headers=auth).json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    # The chat template applied as the worker applies it: the count the worker reports as usage.
    response = openai.OpenAI(
        base_url=gateway.base_url, api_key=API_KEY, max_retries=0
    ).chat.completions.create(model="smollm2", messages=CHAT, max_tokens=1)
    assert chat["count"] == response.usage.prompt_tokens
    bad = httpx.post(f"{gateway.url}/detokenize", json={"tokens": [10**9]}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.timeout(60)
def test_metrics_count_requests_by_route_and_status(gateway, sdk, worker):
    sdk.models.list()
    sdk.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=1)
    sdk.completions.create(model="smollm2", prompt="Hi", max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="no-such-model", messages=CHAT)
    text = httpx.get(f"{gateway.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    assert metric_value(text, 'qworker_gateway_requests_total{route="/v1/models",status="200"}') >= 1
    assert (
        metric_value(text, 'qworker_gateway_requests_total{route="/v1/chat/completions",status="200"}') >= 1
    )
    assert (
        metric_value(text, 'qworker_gateway_requests_total{route="/v1/chat/completions",status="404"}') >= 1
    )
    assert (
        metric_value(text, 'qworker_gateway_time_to_first_byte_seconds_count{route="/v1/completions"}') >= 1
    )
    assert metric_value(text, "qworker_gateway_enqueue_to_first_token_seconds_count") >= 1
    assert metric_value(text, "qworker_gateway_inflight_streams") == 0


@pytest.mark.timeout(120)
def test_streaming_n_and_logprobs_assemble_to_the_stored_outputs(sdk, store, worker):
    """Choice 0 streams live; the other completions of n and the logprobs (which the delta stream
    does not carry) arrive when the job ends; each choice assembles to its stored completion."""
    chunks = list(
        sdk.chat.completions.create(
            model="smollm2",
            messages=CHAT,
            max_tokens=5,
            temperature=0.8,
            seed=3,
            n=2,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
    )
    texts = {0: "", 1: ""}
    logprobs: dict[int, list] = {0: [], 1: []}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None:
                logprobs[choice.index] += choice.logprobs.content
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    result = store.result(job_id_of(chunks[0].id), timeout=10)
    for completion in result.outputs:
        assert texts[completion.index] == completion.text
        assert [p.logprob for p in logprobs[completion.index]] == pytest.approx(
            [p.logprob for p in completion.logprobs]
        )
        assert all(len(p.top_logprobs) == 2 for p in logprobs[completion.index])
        assert finish[completion.index] == completion.finish_reason

"""Hostile HTTP against a gateway on the in-memory queue with the scripted FakeEngine worker (no
model, no Redis): property-based requests from the app's own OpenAPI schema (schemathesis, a
capped number of examples) and targeted bad input. Nothing a client sends gets a 500, and no job
is left waiting or held."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from qworker.backends.connections import open_sink, open_source
from qworker.gateway.app import create_app
from qworker.gateway.http_protocol import server_options
from qworker.gateway.settings import GatewaySettings
from qworker.testing.fake_engine import FakeEngine
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings
from tests.gateway.conftest import serve_app

KEY = "sk-hostile-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {KEY}"}
# Examples per operation: the whole run stays within a few seconds on 2 cores. The longer run:
#   QWORKER_GATEWAY_FUZZ_EXAMPLES=1000 .venv/bin/python -m pytest tests/gateway/test_hostile_http.py -k fuzz
MAX_EXAMPLES = int(os.environ.get("QWORKER_GATEWAY_FUZZ_EXAMPLES", "8"))
HEADER_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def fake_pool():
    url = f"memory://gateway-hostile-{uuid.uuid4().hex[:8]}"
    worker = Worker(
        FakeEngine(max_model_len=256),
        open_source(url, consumer="fake-1"),
        open_sink(url),
        WorkerSettings(name="fake-1", poll_interval_s=0.02, cancel_check_interval_s=0.02),
    )
    thread = threading.Thread(target=worker.run, name="fake-worker", daemon=True)
    thread.start()
    yield url, worker
    worker.stop()
    thread.join(timeout=10)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the tokenizers ByteLevel pre-tokenizer uses."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def write_byte_tokenizer(directory) -> None:
    """A tokenizer.json whose token id is the UTF-8 byte: the FakeEngine's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def app(fake_pool, tmp_path_factory):
    url, _ = fake_pool
    tokenizer_dir = tmp_path_factory.mktemp("byte-tokenizer")
    write_byte_tokenizer(tokenizer_dir)
    settings = GatewaySettings(
        model="fake",
        tokenizer=str(tokenizer_dir),
        request_timeout_s=5,
        max_body_bytes=1 << 20,
        max_model_len=256,
        limit_concurrency=40,
        timeout_keep_alive_s=1,
        header_timeout_s=HEADER_TIMEOUT_S,
    )
    return create_app(settings, queue=url, api_keys=frozenset({KEY}))


@pytest.fixture(scope="module")
def served(app):
    # The connection options of `qworker gateway` itself: the head deadline and the hard cap.
    with serve_app(app, **server_options(app.state.gateway.settings)) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def api_schema(app):
    # The schema the app publishes at /openapi.json (behind the key, as every route but the probes).
    return schemathesis.openapi.from_dict(app.openapi())


@pytest.mark.timeout(max(240, MAX_EXAMPLES * 20))
def test_fuzzed_requests_never_get_a_500(api_schema, served):
    """Every operation of the published schema, MAX_EXAMPLES generated requests each. (Driven
    through hypothesis directly: schemathesis' pytest plugin does not load on this pytest.)"""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8, [op.label for op in operations]
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def check(case) -> None:
            response = case.call(base_url=served.url, headers=AUTH, timeout=20)
            # 501 not_supported: a route this pool's backend declares it cannot serve (issue 23's
            # Files and Batches keep their state in Redis, not in memory://): an answer, not a crash.
            # 502 incomplete_result: the FakeEngine computes no logprobs, so a request for them gets
            # the gateway's answer to an incomplete upstream result (the real engine has them).
            code = response.json()["error"]["code"] if response.status_code >= 500 else None
            is_declared = (response.status_code, code) in ((501, "not_supported"), (502, "incomplete_result"))
            assert response.status_code < 500 or is_declared, (
                f"{case.method} {case.path} {case.body!r:.300} -> {response.status_code}: "
                f"{response.text[:500]}"
            )
            if response.status_code >= 400 and case.path != "/readyz":
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"]

        check()


@pytest.mark.timeout(30)
def test_no_job_is_left_waiting_or_held(fake_pool, served):
    url, worker = fake_pool
    from qworker.jobs.client import Client

    with Client(queue=url) as client:
        deadline = time.monotonic() + 10
        while client.queue_depth() or worker.num_jobs_held:
            assert time.monotonic() < deadline, (client.queue_depth(), worker.num_jobs_held)
            time.sleep(0.05)


def post(served, path: str, content: bytes, content_type: str = "application/json", headers=None):
    return httpx.post(
        f"{served.url}{path}",
        content=content,
        headers={"Content-Type": content_type, **AUTH, **(headers or {})},
        timeout=20,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("content", "content_type", "status"),
    [
        (b'{"model": "fake", "messages": [', "application/json", 400),  # invalid JSON
        (b'{"model": "fake", "prompt": "\xff\xfe"}', "application/json", 400),  # invalid UTF-8
        (b'{"model": "fake", "prompt": "hi"}', "text/plain", 400),  # wrong content type
        (b"[1, 2, 3]", "application/json", 400),  # not an object
        (b'{"model": "fake", "prompt": "hi", "n": 1000000000}', "application/json", 400),
        (b'{"model": "fake", "prompt": "hi", "max_tokens": -1}', "application/json", 400),
        (b'{"model": "fake", "prompt": "hi", "temperature": "hot"}', "application/json", 400),
        (b'{"model": "fake", "prompt": "hi", "best_of": 3}', "application/json", 400),
        (b'{"model": "fake", "prompt": "hi", "priority": 1e400}', "application/json", 400),
        (b'{"model": "other", "prompt": "hi"}', "application/json", 404),
        # Found by the fuzzer: a token id no tokenizer can decode, echoed.
        (b'{"model": "fake", "prompt": [-1, 1180591620717411303424], "echo": true}', "application/json", 400),
        (b'{"model": "fake", "prompt": [-100000000000000000000], "echo": true}', "application/json", 400),
        (b'{"model": "fake", "prompt": ""}', "application/json", 400),
    ],
)
def test_bad_bodies_get_openai_errors(served, content, content_type, status):
    response = post(served, "/v1/completions", content, content_type)
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"]


@pytest.mark.timeout(60)
def test_huge_prompts_and_bodies(served):
    ten_mb = b'{"model": "fake", "prompt": "' + b"a" * 10_000_000 + b'"}'
    # Over this gateway's 1 MiB body limit: 413 before the body is read.
    assert post(served, "/v1/completions", ten_mb).status_code == 413
    chunked = httpx.post(
        f"{served.url}/v1/completions",
        content=iter([ten_mb[i : i + 65536] for i in range(0, len(ten_mb), 65536)]),
        headers={"Content-Type": "application/json", **AUTH},
        timeout=20,
    )
    assert chunked.status_code == 413, "a chunked body is cut off at the limit"
    # Under the limit but far past the context: 400 context_length_exceeded.
    long_prompt = post(served, "/v1/completions", b'{"model": "fake", "prompt": "' + b"a " * 400_000 + b'"}')
    assert long_prompt.status_code == 400 and long_prompt.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.timeout(30)
def test_byte_tokenizer_matches_the_fake_engine(served):
    tokens = post(served, "/tokenize", b'{"prompt": "hi \xc3\xa9"}').json()["tokens"]
    assert tokens == list("hi é".encode())
    assert post(served, "/detokenize", b'{"tokens": [104, 105]}').json() == {"prompt": "hi"}
    # This tokenizer has no chat template: messages are a 400, not a 500 (found by the fuzzer).
    no_template = post(served, "/tokenize", b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert no_template.status_code == 400 and no_template.json()["error"]["param"] == "messages"


@pytest.mark.timeout(30)
def test_auth(served):
    body = b'{"model": "fake", "prompt": "hi", "max_tokens": 2}'
    no_key = httpx.post(
        f"{served.url}/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "missing_api_key"
    wrong = post(served, "/v1/completions", body, headers={"Authorization": "Bearer sk-wrong"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{served.url}/metrics").status_code == 401
    assert httpx.get(f"{served.url}/healthz").status_code == 200
    ok = post(served, "/v1/completions", body)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ab"


def _read_until_closed(sock: socket.socket, limit_s: float) -> bytes:
    """What the server sends before it closes `sock` (socket.timeout past `limit_s`)."""
    sock.settimeout(limit_s)
    received = b""
    while chunk := sock.recv(4096):
        received += chunk
    return received


@pytest.mark.timeout(60)
def test_slow_headers_are_cut_off_while_others_are_served(served):
    """A slowloris client dribbling its request head a byte at a time gets a 408 in OpenAI's
    error shape and is closed after --header-timeout-s (1 s here), while other requests are
    served; a connection that sends nothing at all is closed the same way."""
    host, port = served.url.removeprefix("http://").split(":")
    slow = socket.create_connection((host, int(port)))
    silent = socket.create_connection((host, int(port)))
    started = time.monotonic()
    try:
        head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 1000
        sent = 0
        while time.monotonic() - started < HEADER_TIMEOUT_S + 5:
            try:
                slow.send(head[sent % len(head) : sent % len(head) + 1])
            except OSError:  # the server closed it: the reset reaches the next send
                break
            sent += 1
            if sent % 20 == 0:
                ok = httpx.get(f"{served.url}/v1/models", headers=AUTH, timeout=5)
                assert ok.status_code == 200
            time.sleep(0.01)
        answer = _read_until_closed(slow, 10)
        elapsed = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert b'"type":"timeout"' in answer.replace(b" ", b"")
        # Cut off near the deadline (not at once, and long before the loop's own end).
        assert HEADER_TIMEOUT_S * 0.9 <= elapsed < HEADER_TIMEOUT_S + 5
        quiet = _read_until_closed(silent, 10)
        assert quiet.startswith(b"HTTP/1.1 408 ")
    finally:
        slow.close()
        silent.close()


@pytest.mark.timeout(60)
def test_idle_connections_are_bounded(served):
    """Connections over --limit-concurrency (40 here) get a 503 at once and are closed; the open
    ones are closed after the head deadline, and the gateway serves again."""
    host, port = served.url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(45)]
    try:
        answers = []
        for s in idle[-5:]:
            answers.append(_read_until_closed(s, 5))
        # The 40 first hold the slots: the last ones are refused without sending a byte.
        assert all(a.startswith(b"HTTP/1.1 503 ") for a in answers), [a[:40] for a in answers]
        for s in idle[:5]:
            answer = _read_until_closed(s, 10)
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while httpx.get(f"{served.url}/v1/models", headers=AUTH, timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "the gateway did not serve again once the idle ones closed"
        time.sleep(0.1)


@pytest.mark.timeout(30)
def test_streaming_on_the_fake_pool(served):
    body = (
        b'{"model": "fake", "prompt": "hi", "max_tokens": 5, "stream": true,'
        b' "stream_options": {"include_usage": true}}'
    )
    with httpx.stream(
        "POST",
        f"{served.url}/v1/completions",
        content=body,
        headers={"Content-Type": "application/json", **AUTH},
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    import json

    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "abcde"
    assert chunks[-1]["usage"]["completion_tokens"] == 5

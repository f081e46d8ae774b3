"""Async jobs on the gateway, RunPod-shaped: submit, poll, stream, cancel; webhooks signed as
Standard Webhooks specifies and verified here with the `standardwebhooks` package; receivers that
answer 500 or never answer are retried within the cap and recorded, the job's result untouched;
webhook targets outside the allow-list refused at submission and, after DNS changes its answer,
at connect time; Idempotency-Key on POST /v1/jobs.

One worker (the tiny random model, fp32, one thread) and one gateway (in this process) serve the
module; the webhook receiver is a loopback HTTP server that the gateway's allow-list admits.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import redis as redis_lib
from standardwebhooks import Webhook

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.gateway.app import create_app
from qworker.gateway.async_api.webhook_targets import WebhookPolicy, WebhookTargetError
from qworker.gateway.async_api.webhooks import deliver
from qworker.gateway.settings import GatewaySettings
from qworker.jobs.client import Client
from qworker.testing.worker_kit import cleanup, redis_base_url, spawn_worker, unique_url
from tests.gateway.conftest import serve_app
from tests.integration.batch_support import write_batch_model_dir

KEY_A = "sk-jobs-a-0123456789"
KEY_B = "sk-jobs-b-0123456789"
SECRET = "whsec_" + base64.b64encode(b"qworker-test-webhook-secret-32by").decode()
MAX_ATTEMPTS = 3
TIMEOUT_S = 0.5


class Receiver:
    """A loopback webhook receiver: /ok verifies and keeps each delivery, /fail answers 500,
    /hang answers after the gateway's delivery timeout."""

    def __init__(self) -> None:
        self.verified: list[dict[str, Any]] = []
        self.hits: dict[str, int] = {}
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                with receiver.lock:
                    receiver.hits[self.path] = receiver.hits.get(self.path, 0) + 1
                if self.path == "/hang":
                    time.sleep(TIMEOUT_S * 3)
                if self.path == "/ok":
                    payload = Webhook(SECRET).verify(body, dict(self.headers))
                    with receiver.lock:
                        receiver.verified.append(
                            {"payload": payload, "webhook-id": self.headers["webhook-id"]}
                        )
                self.send_response(204 if self.path == "/ok" else 500)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def receiver():
    served = Receiver()
    yield served
    served.server.shutdown()


@pytest.fixture(scope="module")
def pool_url():
    url = unique_url(redis_base_url(), tag="gw-jobs")
    yield url
    cleanup(redis_lib.Redis.from_url(parse_url(url, SOURCE_PARAMS | SINK_PARAMS).connection_url), url)


@pytest.fixture(scope="module")
def worker(pool_url, tmp_path_factory):
    model_dir = write_batch_model_dir(tmp_path_factory.getbasetemp() / "gw-tiny-model")
    log = tmp_path_factory.mktemp("gw-jobs-worker") / "w.log"
    process = spawn_worker(pool_url, model_dir, "gjw1", "--num-kv-blocks", "256", log_path=log)
    yield
    # SIGKILL: nothing of the module's unique queue needs a drain.
    process.kill()
    process.wait(timeout=60)


@pytest.fixture(scope="module")
def gateway(pool_url, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gw-jobs")
    (folder / "secret").write_text(SECRET)
    settings = GatewaySettings(
        model="tiny",
        files_url=str(folder / "files"),
        webhook_secret_file=str(folder / "secret"),
        webhook_allow="127.0.0.1/32",
        webhook_max_attempts=MAX_ATTEMPTS,
        webhook_backoff_s=0.1,
        webhook_max_backoff_s=0.2,
        webhook_timeout_s=TIMEOUT_S,
    )
    app = create_app(settings, queue=pool_url, api_keys=frozenset({KEY_A, KEY_B}))
    with serve_app(app) as served:
        yield served


@pytest.fixture(scope="module")
def http(gateway):
    with httpx.Client(
        base_url=gateway.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30
    ) as client:
        yield client


@pytest.fixture(scope="module")
def store(pool_url):
    with Client(queue=pool_url) as client:
        yield client


def job(prompt: str, max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "params": {"max_tokens": max_tokens, "temperature": 0}, **extra}


def wait_status(http: httpx.Client, job_id: str, done: Any, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = http.get(f"/v1/jobs/{job_id}").json()
        if done(body):
            return body
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id}: {body}")


@pytest.mark.timeout(90)
def test_a_job_completes_and_its_signed_webhook_verifies(http, worker, receiver, store):
    reply = http.post("/v1/jobs", json=job("Once upon a time", webhook=f"{receiver.url}/ok"))
    assert reply.status_code == 200, reply.text
    submitted = reply.json()
    assert submitted["status"] == "IN_QUEUE" and submitted["id"]
    job_id = submitted["id"]
    final = wait_status(http, job_id, lambda b: b.get("webhook_status") == "delivered")
    assert final["status"] == "COMPLETED" and final["webhook_attempts"] == 1
    stored = store.result(job_id, timeout=5)
    assert final["output"]["text"] == stored.text and final["output"]["token_ids"] == stored.token_ids
    [delivery] = [d for d in receiver.verified if d["payload"]["id"] == job_id]
    assert delivery["payload"]["status"] == "COMPLETED"
    assert delivery["payload"]["output"]["text"] == stored.text
    assert delivery["webhook-id"] == f"msg_{job_id}"
    # Another key does not see the job.
    other = httpx.get(f"{http.base_url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {KEY_B}"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "job_not_found"


@pytest.mark.timeout(90)
def test_failing_and_silent_receivers_are_retried_within_the_cap_and_recorded(http, worker, receiver, store):
    ids = {}
    for path in ("fail", "hang"):
        reply = http.post("/v1/jobs", json=job(f"Receiver {path}", webhook=f"{receiver.url}/{path}"))
        ids[path] = reply.json()["id"]
    for path, job_id in ids.items():
        final = wait_status(http, job_id, lambda b: b.get("webhook_status") == "failed", timeout_s=60)
        assert final["webhook_attempts"] == MAX_ATTEMPTS
        assert final["status"] == "COMPLETED", "the job's result is not affected by its webhook"
        assert final["output"]["text"] == store.result(job_id, timeout=5).text
        assert ("500" if path == "fail" else "timed out") in final["webhook_error"]
    time.sleep(0.5)
    assert receiver.hits["/fail"] == MAX_ATTEMPTS and receiver.hits["/hang"] == MAX_ATTEMPTS, (
        "never retried forever"
    )


@pytest.mark.timeout(90)
def test_stream_then_cancel(http, worker, store):
    job_id = http.post("/v1/jobs", json=job("Stream me", max_tokens=12)).json()["id"]
    texts, end = [], None
    with http.stream("GET", f"/v1/jobs/{job_id}/stream") as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in reply.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                if event == "end":
                    end = data
                    break
                texts.append(data["text"])
    assert end is not None and end["status"] == "COMPLETED"
    assert "".join(texts) == store.result(job_id, timeout=5).text == end["output"]["text"]
    # A long job, cancelled while it runs.
    long_job = job("Go on forever", max_tokens=400)
    long_job["params"]["ignore_eos"] = True
    long_id = http.post("/v1/jobs", json=long_job).json()["id"]
    wait_status(http, long_id, lambda b: b["status"] == "IN_PROGRESS")
    assert http.post(f"/v1/jobs/{long_id}/cancel").json()["status"] == "CANCELLED"
    final = wait_status(http, long_id, lambda b: "output" in b)
    assert final["status"] == "CANCELLED" and len(final["output"]["token_ids"]) < 400


@pytest.mark.timeout(30)
def test_bad_jobs_and_webhooks_outside_the_allow_list_get_400(http):
    for url in (
        "http://10.0.0.1/hook",
        "http://169.254.169.254/latest/meta-data",
        "ftp://127.0.0.1/x",
        "nope",
    ):
        reply = http.post("/v1/jobs", json=job("x", webhook=url))
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "webhook", (url, reply.text)
    assert http.post("/v1/jobs", content=b"{nope").status_code == 400
    bad = http.post("/v1/jobs", json={"prompt": "x", "params": {"max_tokens": -1}})
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    assert http.get("/v1/jobs/not-a-job").status_code == 404


@pytest.mark.timeout(30)
def test_idempotency_key_on_jobs(http):
    key = {"Idempotency-Key": "job-retry-1"}
    first = http.post("/v1/jobs", json=job("Same"), headers=key).json()
    again = http.post("/v1/jobs", json=job("Same"), headers=key).json()
    assert first["id"] == again["id"]
    changed = http.post("/v1/jobs", json=job("Different"), headers=key)
    assert changed.status_code == 422 and changed.json()["error"]["code"] == "idempotency_key_reused"


@pytest.mark.timeout(30)
def test_the_connect_time_check_refuses_a_host_that_now_resolves_inside(monkeypatch, receiver):
    """DNS rebinding: a name the allow-list admits at submission resolves to a private address
    later; the delivery checks the address it would connect to, and refuses."""
    policy = WebhookPolicy("127.0.0.1/32")
    port = int(receiver.url.rsplit(":", 1)[1])
    answers = iter(["127.0.0.1", "10.1.2.3"])
    real = socket.getaddrinfo

    def rebinding(host: str, *args: Any, **kwargs: Any) -> Any:
        if host == "hooks.example.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), port))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    policy.check(f"http://hooks.example.test:{port}/ok")  # submission: 127.0.0.1, allowed
    secret = base64.b64decode(SECRET.removeprefix("whsec_"))
    with pytest.raises(WebhookTargetError, match=r"10\.1\.2\.3"):
        deliver(policy, secret, f"http://hooks.example.test:{port}/ok", "msg_x", b"{}", TIMEOUT_S)


@pytest.mark.timeout(10)
def test_the_allow_list_rules():
    import ipaddress

    default = WebhookPolicy("")
    for address in (
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "::1",
        "fc00::1",
    ):
        assert not default.is_allowed("any.example", ipaddress.ip_address(address)), address
    assert default.is_allowed("any.example", ipaddress.ip_address("8.8.8.8"))
    listed = WebhookPolicy("hooks.example.com, 10.5.0.0/16")
    assert listed.is_allowed("hooks.example.com", ipaddress.ip_address("8.8.8.8"))
    assert not listed.is_allowed("other.example", ipaddress.ip_address("8.8.8.8")), "a host list is a list"
    assert listed.is_allowed("other.example", ipaddress.ip_address("10.5.1.1")), "a listed network"
    assert not listed.is_allowed("hooks.example.com", ipaddress.ip_address("10.6.0.1")), (
        "a name opens no range"
    )

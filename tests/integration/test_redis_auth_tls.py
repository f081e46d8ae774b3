"""Redis URLs with a password and rediss:// (TLS) work for the queue, the
results and the Client; AWS credentials, Redis passwords and prompts never reach the logs unless
payload logging is switched on.

A private redis-server (requirepass, and a TLS port with a throwaway CA made by the openssl CLI)
runs on free loopback ports for this module; jobs go through an in-process worker in burst mode on
the tiny random model."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
import uuid

import pytest
import redis as redis_lib

from qworker.backends.connections import open_sink, open_source, redact_url
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.jobs.client import Client
from qworker.jobs.job import JobStatus
from qworker.testing.worker_kit import unique_url
from qworker.worker.loop import Worker
from qworker.worker.settings import PAYLOAD_LOGGERS, WorkerSettings, quiet_payload_loggers

from .conftest import free_port

PASSWORD = "s3cr3t-Redis-Pw-7f2c9"
AWS_SECRET = "AwsSecretKey-DoNotLog-91b4e0"
PROMPT = "Tell me about the zebra-quokka-8812 protocol."

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("openssl") is None,
    reason="needs redis-server and openssl on PATH",
)


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _make_certs(directory) -> None:
    """ca.pem/ca.key, and server.pem/server.key signed by it for 127.0.0.1 and localhost."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=qworker-test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=directory)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
             "-keyout", "server.key", "-out", "server.csr", cwd=directory)  # fmt: skip
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "san.ext", "-out", "server.pem", cwd=directory)  # fmt: skip


class PrivateRedis:
    def __init__(self, directory) -> None:
        self.dir = directory
        self.port = free_port()
        self.tls_port: int | None = None
        self.tls_skip_reason: str | None = None
        self.process: subprocess.Popen | None = None

    def _start(self, tls: bool) -> subprocess.Popen:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--requirepass", PASSWORD,
                "--save", "", "--appendonly", "no", "--dir", str(self.dir)]  # fmt: skip
        if tls:
            self.tls_port = free_port()
            args += ["--tls-port", str(self.tls_port), "--tls-cert-file", "server.pem",
                     "--tls-key-file", "server.key", "--tls-ca-cert-file", "ca.pem",
                     "--tls-auth-clients", "no"]  # fmt: skip
        log = open(self.dir / "redis.log", "w")  # noqa: SIM115 - the process owns it
        return subprocess.Popen(args, cwd=self.dir, stdout=log, stderr=subprocess.STDOUT)

    def start(self) -> None:
        _make_certs(self.dir)
        self.process = self._start(tls=True)
        time.sleep(0.3)
        if self.process.poll() is not None:
            # A build without TLS support refuses the tls-* options and exits.
            self.tls_skip_reason = (
                "this redis-server build has no TLS support (it rejected --tls-port): "
                + (self.dir / "redis.log").read_text()[-300:].strip()
            )
            self.tls_port = None
            self.process = self._start(tls=False)
        deadline = time.monotonic() + 10
        while True:
            try:
                redis_lib.Redis(port=self.port, password=PASSWORD, socket_connect_timeout=0.5).ping()
                return
            except redis_lib.RedisError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(
                        f"redis-server did not start: {(self.dir / 'redis.log').read_text()}"
                    ) from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()

    @property
    def url(self) -> str:
        return f"redis://:{PASSWORD}@127.0.0.1:{self.port}/0"

    def tls_url(self, query: str) -> str:
        if self.tls_port is None:
            pytest.skip(self.tls_skip_reason or "no TLS port")
        return f"rediss://:{PASSWORD}@127.0.0.1:{self.tls_port}/0?{query}"


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory):
    server = PrivateRedis(tmp_path_factory.mktemp("redis-auth-tls"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu"))


def run_jobs(engine, queue_url: str, results_url: str | None = None, prompts=("Hi", "Hello", "Hey")):
    results_url = results_url or queue_url
    jobs = [
        {"messages": [{"role": "user", "content": p}], "params": {"max_tokens": 3, "temperature": 0.0}}
        for p in prompts
    ]
    with Client(queue=queue_url, results=results_url) as client:
        ids = client.submit_many(jobs)
        source, sink = open_source(queue_url, consumer="auth"), open_sink(results_url)
        Worker(engine, source, sink, WorkerSettings(name=f"auth-{uuid.uuid4().hex[:6]}")).run(burst=True)
        source.close()
        sink.close()
        results = client.results(ids, timeout=10)
    for result in results:
        assert result.status is JobStatus.COMPLETED, result.error
        assert 1 <= result.usage.completion_tokens <= 3
    return results


@pytest.mark.timeout(60)
def test_password_is_required_and_used(private_redis, engine):
    with pytest.raises(redis_lib.AuthenticationError):
        redis_lib.Redis(port=private_redis.port, password="wrong").ping()
    with pytest.raises(redis_lib.exceptions.AuthenticationError):
        redis_lib.Redis(port=private_redis.port).set("k", "v")
    run_jobs(engine, unique_url(private_redis.url, tag="auth"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("verify", ["ca", "none"])
def test_rediss_with_password(private_redis, engine, verify):
    query = f"ssl_ca_certs={private_redis.dir / 'ca.pem'}" if verify == "ca" else "ssl_cert_reqs=none"
    run_jobs(engine, unique_url(private_redis.tls_url(query), tag="tls"))


@pytest.mark.timeout(30)
def test_rediss_rejects_an_unknown_ca(private_redis):
    # Verification is on by default: the throwaway CA is in no trust store.
    url = private_redis.tls_url("socket_connect_timeout=2")
    with pytest.raises(redis_lib.ConnectionError):
        open_sink(unique_url(url, tag="tls")).has_result("x")


def test_redact_url():
    assert PASSWORD not in redact_url(f"rediss://:{PASSWORD}@h:6380/0?ssl_cert_reqs=none")
    assert redact_url("redis://user:pw@h:1/0?stream=s") == "redis://user:***@h:1/0?stream=s"
    assert redact_url("redis://h:1/0?password=pw&stream=s") == "redis://h:1/0?password=***&stream=s"
    assert redact_url("sqs://q?region=eu-west-1") == "sqs://q?region=eu-west-1"


@pytest.fixture
def restore_library_log_levels():
    levels = {name: logging.getLogger(name).level for name in PAYLOAD_LOGGERS}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def _logged_text(caplog) -> str:
    parts = []
    for record in caplog.records:
        parts.append(record.getMessage())
        if record.exc_text:
            parts.append(record.exc_text)
    return "\n".join(parts)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
@pytest.mark.parametrize("log_payloads", [False, True])
def test_secrets_and_prompts_stay_out_of_logs(
    private_redis, engine, moto_server, monkeypatch, caplog, restore_library_log_levels, level, log_payloads
):
    """SQS queue (moto, a distinctive AWS secret in the environment for boto3's chain) with results
    in the password-protected Redis: neither secret, nor the prompt, is in any log record, at INFO
    or DEBUG, unless QWORKER_LOG_PAYLOADS=1 and DEBUG (then the prompt is; the secrets still not)."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    if log_payloads:
        monkeypatch.setenv("QWORKER_LOG_PAYLOADS", "1")
    else:
        monkeypatch.delenv("QWORKER_LOG_PAYLOADS", raising=False)
    caplog.set_level(level)
    # What `qworker worker` does at startup, after logging.basicConfig.
    quiet_payload_loggers(log_payloads)
    queue = f"auth-{uuid.uuid4().hex[:8]}"
    moto_server.client("sqs").create_queue(QueueName=queue)
    queue_url = f"sqs://{queue}?{moto_server.query}"
    results_url = unique_url(private_redis.url, tag="logs")
    logging.getLogger("qworker.test").info("queue %s, results %s", queue_url, redact_url(results_url))
    run_jobs(engine, queue_url, results_url, prompts=(PROMPT, "Hi"))

    text = _logged_text(caplog)
    assert caplog.records, "expected some log records"
    assert AWS_SECRET not in text
    assert PASSWORD not in text
    if log_payloads and level == logging.DEBUG:
        # qworker's own payload line; library loggers (botocore's bodies) are let through as well.
        assert any(PROMPT in r.getMessage() for r in caplog.records if r.name.startswith("qworker"))
    else:
        assert PROMPT not in text

"""`--model s3://bucket/prefix/`: a Hugging Face directory on S3 (moto's server on loopback),
downloaded once into the cache. Between boto3 and moto sits a small HTTP proxy in this process
that counts the GETs and bytes of each object and can slow bodies down, so that a download can be
killed midway and two concurrent starts can be seen to fetch every object once."""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from qworker.errors import ConnectError
from qworker.model_store import ModelDownloadError
from qworker.model_store.s3 import COMPLETE_MARKER, PARTIAL_DIR, S3ModelURL
from tests.integration.conftest import wait_for
from tests.unit.test_first_contact_errors import NO_AWS, one_line_error

pytestmark = pytest.mark.timeout(120)

ENGINE_ARGS = dict(dtype="float32", device="cpu", num_kv_blocks=64, block_size=16)
PROMPTS = [{"prompt_token_ids": [1, 17, 300, 4000, 25]}, {"prompt_token_ids": [9, 8, 7]}]
# The 12.6 MB embedding is one tensor (a shard holds whole tensors): two shards, one of ~12.6 MB.
MAX_SHARD_SIZE = "4MB"
# Big enough that boto3 uploads it in parts (ETag "<md5>-N"), so the multipart check runs.
MULTIPART_BYTES = 5 * 2**20


class ThrottlingProxy:
    """Forwards HTTP to moto; counts GETs and body bytes per path; sleeps between body chunks
    while `bytes_per_s` is set. `reset()` starts a new count: a response begun before it (to a
    client since killed) stops and counts nothing more."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.bytes_per_s: float | None = None
        self.gets: Counter[str] = Counter()
        self.body_bytes: Counter[str] = Counter()
        self.generation = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                generation = proxy.generation
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = proxy.upstream.netloc
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                path = urlsplit(self.path).path
                if self.command == "GET":
                    with proxy._lock:
                        proxy.gets[path] += 1
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection"):
                        self.send_header(key, value)
                self.end_headers()
                try:
                    while chunk := response.read(64 * 1024):
                        with proxy._lock:
                            if generation != proxy.generation:
                                break  # sleeping when its client was killed and the count reset
                            proxy.body_bytes[path] += len(chunk)
                        self.wfile.write(chunk)
                        if proxy.bytes_per_s:
                            time.sleep(len(chunk) / proxy.bytes_per_s)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client was killed mid-body
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                # A client killed mid-request (the SIGKILL test) resets its connection: expected.
                if not isinstance(sys.exc_info()[1], ConnectionError):
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint_url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def reset(self) -> None:
        with self._lock:
            self.generation += 1
            self.bytes_per_s = None
            self.gets.clear()
            self.body_bytes.clear()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def proxy(moto_server):
    proxy = ThrottlingProxy(moto_server.endpoint_url)
    yield proxy
    proxy.close()


@pytest.fixture(scope="module")
def sharded_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """conftest's tiny random Llama (qworker.testing.tiny_model) with the SmolLM2 tokenizer, saved sharded."""
    from transformers import AutoModelForCausalLM

    target = tmp_path_factory.mktemp("sharded-tiny")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.save_pretrained(target, safe_serialization=True, max_shard_size=MAX_SHARD_SIZE)
    for path in Path(tiny_model_dir).iterdir():
        if not path.name.endswith(".safetensors") and not (target / path.name).exists():
            shutil.copy(path, target / path.name)
    assert (target / "model.safetensors.index.json").is_file() and len(
        list(target.glob("*.safetensors"))
    ) >= 2
    return target


@pytest.fixture(scope="module")
def reference_tokens(sharded_model_dir) -> list[list[int]]:
    return generate(str(sharded_model_dir))


def generate(model: str) -> list[list[int]]:
    from qworker import LLM, SamplingParams

    llm = LLM(model=model, **ENGINE_ARGS)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return [list(out.outputs[0].token_ids) for out in outputs]


class ModelBucket:
    def __init__(self, moto, proxy: ThrottlingProxy, model_dir: Path) -> None:
        from boto3.s3.transfer import TransferConfig

        self.name = f"qw-model-{uuid.uuid4().hex[:10]}"
        self.prefix = "models/tiny/"
        self.model_dir = model_dir
        self.proxy = proxy
        self.s3 = moto.client("s3")
        self.s3.create_bucket(Bucket=self.name)
        multipart = TransferConfig(multipart_threshold=MULTIPART_BYTES, multipart_chunksize=MULTIPART_BYTES)
        for path in sorted(model_dir.iterdir()):
            self.s3.upload_file(str(path), self.name, self.prefix + path.name, Config=multipart)
        self.region = moto.region

    @property
    def url(self) -> str:
        return f"s3://{self.name}/{self.prefix}?endpoint_url={self.proxy.endpoint_url}&region={self.region}"

    def key_path(self, name: str) -> str:
        return f"/{self.name}/{self.prefix}{name}"

    def object_gets(self) -> dict[str, int]:
        return {
            path.rsplit("/", 1)[-1]: n
            for path, n in self.proxy.gets.items()
            if path.startswith(f"/{self.name}/")
        }

    def etag(self, name: str) -> str:
        return self.s3.head_object(Bucket=self.name, Key=self.prefix + name)["ETag"].strip('"')


@pytest.fixture
def bucket(moto_server, proxy, sharded_model_dir):
    proxy.reset()
    yield ModelBucket(moto_server, proxy, sharded_model_dir)
    proxy.reset()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("QWORKER_CACHE_DIR", str(cache))
    return cache


def model_cache_dir(cache: Path, url: str) -> Path:
    return cache / "models" / "s3" / S3ModelURL.parse(url).cache_name()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_same_files(downloaded: Path, original: Path) -> None:
    names = sorted(p.name for p in original.iterdir())
    assert sorted(p.name for p in downloaded.iterdir() if not p.name.startswith(".")) == names
    for name in names:
        assert sha256(downloaded / name) == sha256(original / name), name


def resolve_in_subprocess(url: str, cache: Path, log_path: Path) -> subprocess.Popen:
    """A process that resolves (downloads) the model and exits, as a worker's start does."""
    code = (
        "import logging, sys; logging.basicConfig(level='INFO', format='%(levelname)s %(message)s'); "
        "from qworker.model.loader import resolve_model; print(resolve_model(sys.argv[1]).path, flush=True)"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, url],
        stdout=log_path.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "QWORKER_CACHE_DIR": str(cache)},
    )


def test_an_s3_model_loads_and_generates_what_its_directory_does(bucket, cache_dir, reference_tokens):
    etags = {p.name: bucket.etag(p.name) for p in bucket.model_dir.iterdir()}
    assert any("-" in etag for etag in etags.values()), "no multipart upload: the multipart check did not run"
    assert generate(bucket.url) == reference_tokens
    target = model_cache_dir(cache_dir, bucket.url)
    assert (target / COMPLETE_MARKER).is_file()
    assert_same_files(target, bucket.model_dir)
    assert bucket.object_gets() == {name: 1 for name in etags}

    # A second start finds the complete directory and asks S3 nothing: resolve_model is the part
    # of a start that would download (the engine then loads the directory, as the run above did).
    from qworker.model.loader import resolve_model

    bucket.proxy.reset()
    assert resolve_model(bucket.url).path == target
    assert bucket.proxy.gets == Counter()


def test_a_sigkill_mid_download_then_a_restart_resumes_and_completes(bucket, cache_dir, tmp_path):
    largest = max(bucket.model_dir.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    size = largest.stat().st_size
    target = model_cache_dir(cache_dir, bucket.url)
    partial = target / PARTIAL_DIR / largest.name
    bucket.proxy.bytes_per_s = 2e6  # the 12.6 MB shard takes ~6 s
    first = resolve_in_subprocess(bucket.url, cache_dir, tmp_path / "first.log")
    try:
        wait_for(
            lambda: partial.is_file() and partial.stat().st_size > size // 4, 60, "a quarter of the shard"
        )
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    killed_at = partial.stat().st_size
    assert 0 < killed_at < size
    assert not (target / COMPLETE_MARKER).exists() and not (target / largest.name).exists()
    # A killed download is never loaded: without the marker the directory is not handed out, and
    # a new start continues it rather than using what is there.
    bucket.proxy.reset()
    second = resolve_in_subprocess(bucket.url, cache_dir, tmp_path / "second.log")
    assert second.wait(timeout=90) == 0, (tmp_path / "second.log").read_text()
    log = (tmp_path / "second.log").read_text()
    assert f"{largest.name} continues at" in log, log
    assert (target / COMPLETE_MARKER).is_file()
    assert_same_files(target, bucket.model_dir)
    # The restart fetched only what was missing of the shard.
    assert bucket.proxy.body_bytes[bucket.key_path(largest.name)] == size - killed_at


def test_two_workers_starting_at_once_download_the_model_once(bucket, cache_dir, tmp_path):
    """A `qworker worker` and a second process that resolves the same model, started together:
    each object is fetched once, the second waits on the lock and reuses the download, and the
    worker loads the s3:// model to ready (--burst on an empty queue then exits)."""
    bucket.proxy.bytes_per_s = 4e6  # ~3 s of download: both processes start well within it
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("QWORKER_")},
        "QWORKER_CACHE_DIR": str(cache_dir),
        "OMP_NUM_THREADS": "1",
    }
    logs = [tmp_path / "worker.log", tmp_path / "peer.log"]
    worker = subprocess.Popen(
        [sys.executable, "-m", "qworker", "worker", "--burst", "--queue", "memory://jobs", "--model",
         bucket.url, "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64"],
        stdout=logs[0].open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )  # fmt: skip
    peer = resolve_in_subprocess(bucket.url, cache_dir, logs[1])
    assert peer.wait(timeout=100) == 0, logs[1].read_text()[-3000:]
    assert worker.wait(timeout=100) == 0, logs[0].read_text()[-3000:]
    texts = [log.read_text() for log in logs]
    assert " ready" in texts[0], texts[0]
    # The worker's start, by phase: the weights phase is where the S3 download (or the wait) went.
    assert re.search(r"startup: import [\d.]+s, queue_connect [\d.]+s, weights [\d.]+s, ", texts[0]), texts[0]
    assert bucket.object_gets() == {p.name: 1 for p in bucket.model_dir.iterdir()}
    # One downloads; the other waits on the lock, then reuses what the first fetched.
    assert sum(bool(re.search(r"downloading \d+ files", text)) for text in texts) == 1, texts
    assert sum("another process is downloading it" in text for text in texts) == 1, texts
    assert sum("downloaded by another process, reusing" in text for text in texts) == 1, texts


def test_a_truncated_object_is_refused_and_nothing_is_marked_complete(bucket, cache_dir):
    from qworker.model.loader import resolve_model

    shard = min(bucket.model_dir.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = shard.read_bytes()
    bucket.s3.put_object(Bucket=bucket.name, Key=bucket.prefix + shard.name, Body=data[: len(data) - 100])
    with pytest.raises(ModelDownloadError) as info:
        resolve_model(bucket.url)
    message = str(info.value)
    assert f"{shard.name} refused" in message and "truncated or corrupt" in message, message
    target = model_cache_dir(cache_dir, bucket.url)
    assert not (target / COMPLETE_MARKER).exists() and not (target / shard.name).exists()
    assert not (target / PARTIAL_DIR / shard.name).exists(), "a refused partial file is not kept"


def test_a_missing_bucket_is_a_one_line_error(moto_server, tmp_path):
    url = f"s3://qw-no-such-bucket/m/?{moto_server.query}"
    proc = run_worker_once(url, tmp_path)
    assert proc.returncode == 3, proc.stderr
    line = one_line_error(proc)
    assert "cannot download the model s3://qw-no-such-bucket/m/: the service answered NoSuchBucket" in line


def test_missing_credentials_are_a_one_line_error(moto_server, tmp_path):
    proc = run_worker_once(f"s3://any-bucket/m/?{moto_server.query}", tmp_path, env=NO_AWS)
    assert proc.returncode == 3, proc.stderr
    line = one_line_error(proc)
    assert "cannot download the model s3://any-bucket/m/: no AWS credentials found" in line
    assert "AWS_ACCESS_KEY_ID" in line


def test_an_unknown_url_parameter_is_named(tmp_path):
    with pytest.raises(
        ValueError, match=re.escape("unknown URL parameter 'endpoint'. Accepted: endpoint_url, region")
    ):
        S3ModelURL.parse("s3://b/m/?endpoint=http://x")


def run_worker_once(
    model: str, tmp_path: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QWORKER_")}
    if env:
        environ = {k: v for k, v in environ.items() if not k.startswith("AWS_")} | env
    environ |= {"QWORKER_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "qworker", "worker", "--burst", "--queue", "memory://jobs", "--model", model],
        capture_output=True,
        text=True,
        timeout=60,
        env=environ,
    )


def test_a_read_only_model_directory_loads_and_nothing_is_written_into_it(
    sharded_model_dir, reference_tokens, tmp_path, monkeypatch
):
    monkeypatch.setenv("QWORKER_CACHE_DIR", str(tmp_path / "cache"))
    mounted = tmp_path / "mounted"
    shutil.copytree(sharded_model_dir, mounted)

    def snapshot() -> dict[str, tuple[int, int]]:
        return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in mounted.iterdir()}

    before = snapshot()
    for path in [mounted, *mounted.iterdir()]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        assert generate(str(mounted)) == reference_tokens
        # As root, chmod does not stop writes; the listing and times show that none happened.
        assert snapshot() == before
        assert mounted.stat().st_mode & 0o777 == 0o555
    finally:
        mounted.chmod(0o755)


def test_connect_errors_of_llm_name_the_model(moto_server, cache_dir):
    from qworker.model.loader import resolve_model

    with pytest.raises(
        ConnectError, match="cannot download the model s3://qw-absent/x/: the service answered NoSuchBucket"
    ):
        resolve_model(f"s3://qw-absent/x/?{moto_server.query}")

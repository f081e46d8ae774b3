"""`qworker gateway`: its options are GatewaySettings' fields; secrets come from files and the
environment; it starts with no worker and no tokenizer and serves at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from qworker.cli_options import config_option_list
from qworker.gateway.settings import GatewaySettings
from tests.gateway.conftest import free_port


@pytest.mark.timeout(60)
def test_every_setting_is_an_option_and_no_secret_is():
    done = subprocess.run(
        [sys.executable, "-m", "qworker", "gateway", "--help"], capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    for option in config_option_list(GatewaySettings):
        assert option.flag in done.stdout, option.flag
    assert "--api-key-file" in done.stdout and "--api-key " not in done.stdout
    refused = subprocess.run(
        [sys.executable, "-m", "qworker", "gateway", "--api-key", "sk-1"],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert refused.returncode == 2


@pytest.mark.timeout(60)
def test_the_command_serves_with_keys_from_a_file_and_the_environment(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# one key a line\nsk-from-file\n")
    queue_file = tmp_path / "queue"
    queue_file.write_text("memory://gateway-command\n")
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qworker",
            "gateway",
            "--queue-url-file",
            str(queue_file),
            "--api-key-file",
            str(keys),
            "--port",
            str(port),
            "--model",
            "tiny-model",
        ],
        env={**os.environ, "QWORKER_API_KEYS": "sk-env-1, sk-env-2"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.stdout.read().decode()[-3000:]
            assert time.monotonic() - started < 30, "the gateway did not start"
            time.sleep(0.1)
        assert httpx.get(f"{url}/readyz").status_code == 200
        # vLLM's liveness route, open as the probes are (probes written for vLLM send no key).
        vllm_health = httpx.get(f"{url}/health")
        assert (vllm_health.status_code, vllm_health.content) == (200, b"")
        assert httpx.get(f"{url}/v1/models").status_code == 401
        for key in ("sk-from-file", "sk-env-2"):
            models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert models.json()["data"][0]["id"] == "tiny-model"
        # No tokenizer for this model anywhere: the tokenizer routes say so, the rest serves.
        info = httpx.get(f"{url}/tokenizer_info", headers={"Authorization": "Bearer sk-env-1"})
        assert info.status_code == 503 and info.json()["error"]["code"] == "no_tokenizer"
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.mark.timeout(60)
def test_an_unreachable_queue_at_start_is_one_line_and_exit_code_3():
    done = subprocess.run(
        [sys.executable, "-m", "qworker", "gateway", "--port", str(free_port())],
        env={**os.environ, "QWORKER_QUEUE_URL": "redis://:secret@127.0.0.1:1/0?stream=nowhere"},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 3, done.stderr[-2000:]
    assert "cannot connect to the queue" in done.stderr and "secret" not in done.stderr
    assert "Traceback" not in done.stderr

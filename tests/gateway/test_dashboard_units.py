"""The dashboard's parts without a pool: key files with roles (old ones unchanged), the batch
board's arithmetic, the history ring buffer's bound, the Grafana dashboard's shape, the rules
under promtool, and `qworker dashboard` alone."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from qworker.gateway.auth import ApiKeyError, load_api_keys, may_use, role_of
from qworker.pool import batch_board
from qworker.pool.history import read_history, record_sample
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]


def test_a_key_file_without_roles_reads_as_before_and_its_keys_are_admin(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# ops\nsk-one\n\nsk-two\n")
    keys = load_api_keys(path, env={})
    assert keys == frozenset({"sk-one", "sk-two"})
    assert {role_of(keys, k) for k in keys} == {"admin"}


def test_roles_in_the_file_and_the_environment(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-ops   read\nsk-app api\nsk-root admin\n")
    keys = load_api_keys(path, env={"QWORKER_API_KEYS": "sk-env read, sk-env2"})
    assert dict(keys.roles) == {
        "sk-ops": "read",
        "sk-app": "api",
        "sk-root": "admin",
        "sk-env": "read",
        "sk-env2": "admin",
    }
    for bad in ("sk-x owner\n", "sk-x read extra\n"):
        path.write_text(bad)
        with pytest.raises(ApiKeyError):
            load_api_keys(path, env={})
    path.write_text("sk-x read\n")
    with pytest.raises(ApiKeyError, match="two roles"):
        load_api_keys(path, env={"QWORKER_API_KEYS": "sk-x admin"})


def test_what_each_role_may_call():
    assert may_use("admin", "/v1/chat/completions") and may_use("admin", "/dashboard/api/overview")
    assert (
        may_use("read", "/dashboard")
        and may_use("read", "/dashboard/api/overview")
        and may_use("read", "/metrics")
    )
    assert not may_use("read", "/v1/chat/completions") and not may_use("read", "/v1/files")
    assert may_use("api", "/v1/completions") and not may_use("api", "/dashboard/api/overview")
    assert not may_use("read", "/dashboardx")  # a prefix of a path is not the dashboard


def test_the_board_gives_progress_rate_and_eta():
    now = 1000.0
    state = {
        "status": "in_progress",
        "total": 100,
        "completed": 30,
        "failed": 10,
        "run_started_at": now - 20,
        "run_done_at_start": 20,
        "updated_at": now,
    }
    b = batch_board.describe(state, now)
    assert (b["done"], b["remaining"], b["progress"]) == (40, 60, 0.4)
    assert b["rows_per_s"] == pytest.approx(1.0) and b["eta_s"] == pytest.approx(60.0)
    finished = batch_board.describe({**state, "status": "completed", "finished_at": now}, now)
    assert finished["eta_s"] is None


@pytest.fixture
def store():
    url = unique_url(redis_base_url(), "dash-units")
    r = redis.Redis.from_url(url.split("?")[0])
    yield r, url.rsplit("prefix=", 1)[1], url
    cleanup(r, url)


def test_history_is_a_bounded_ring_written_once_per_interval(store):
    r, prefix, _ = store
    assert record_sample(r, prefix, {"depth": 1}, interval_s=60)
    assert not record_sample(r, prefix, {"depth": 2}, interval_s=60)  # another writer, same slot
    for i in range(8):
        r.delete(f"{prefix}:dash:history:slot")
        record_sample(r, prefix, {"t": time.time() + i, "depth": i}, interval_s=60, max_samples=5)
    samples = read_history(r, prefix)
    assert [s["depth"] for s in samples] == [3, 4, 5, 6, 7]


def test_the_board_index_lists_newest_first_and_pages(store):
    r, prefix, _ = store
    for i in range(5):
        board = batch_board.BatchBoard(r, prefix, f"b{i}", source="cli")
        board.state["created_at"] = 100.0 + i
        board.start_run(total=10, done_before=0)
    page, total = batch_board.read_batches(r, prefix, 1, 2)
    assert total == 5 and [b["id"] for b in page] == ["b3", "b2"]
    # A rerun carries on the stored board.
    again = batch_board.BatchBoard.open(r, prefix, "b0", source="cli")
    assert again.state["created_at"] == 100.0 and again.state["total"] == 10


def test_the_grafana_dashboard_is_importable_json():
    dashboard = json.loads((REPO / "infra/grafana/qworker.json").read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    titles = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert titles == ["Pool", "Queue", "Batches", "Gateway"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]


def test_the_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; .ci/run does)")
    done = subprocess.run(
        [promtool, "check", "rules", str(REPO / "infra/prometheus/qworker-rules.yaml")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 5 rules found" in done.stdout


def test_qworker_dashboard_serves_the_page_alone(store):
    from fastapi.testclient import TestClient

    from qworker.gateway.auth import ApiKeys
    from qworker.gateway.dashboard.command import create_dashboard_app

    _, _, url = store
    app = create_dashboard_app(url, api_keys=ApiKeys({"sk-r": "read"}))
    with TestClient(app) as client:
        assert client.get("/dashboard").status_code == 401
        assert client.get("/healthz").status_code == 200
        page = client.get("/dashboard", auth=("x", "sk-r"))
        assert page.status_code == 200 and "/dashboard/static/dashboard.js" in page.text
        overview = client.get("/dashboard/api/overview", headers={"Authorization": "Bearer sk-r"}).json()
        assert overview["pool"]["totals"]["live_workers"] == 0
        assert overview["queues"][0]["depth"] == 0
        assert client.get("/v1/models", headers={"Authorization": "Bearer sk-r"}).status_code == 403

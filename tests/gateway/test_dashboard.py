"""The dashboard (issue 42) against a real pool: a gateway with an admin and a read key, fake-engine
worker processes on the suite's Redis, the pool-demand exporter, a batch through the Batches API.

- the JSON behind the page, field by field against the workers' stats keys and the result store;
- auth: no key 401, a read key 403 on actions and on the API, actions need POST and the CSRF token;
- every metric the Grafana dashboard and the alert rules name is exported by a real endpoint;
- in headless Chromium (Playwright): workers and their KV, a SIGKILLed worker marked stopped in
  time, a new one appearing, the queue depth moving, the batch reaching 100% and `completed`, a
  dead letter's reason, replay from the page, no replay button for a read key, markup in ids shown
  as text; screenshots as artifacts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis

from qworker.gateway.app import create_app
from qworker.gateway.auth import ApiKeys
from qworker.gateway.dashboard import DashboardSettings
from qworker.gateway.settings import GatewaySettings
from qworker.jobs.client import Client
from qworker.pool import batch_board
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url
from tests.gateway.conftest import free_port, serve_app
from tests.gateway.dashboard_kit import (
    ADMIN_KEY,
    READ_KEY,
    Pool,
    make_dead_letter,
    spawn_fake_worker,
    stream_of,
)

pytestmark = pytest.mark.timeout(180)

INTERVAL_S = 1.0
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("DASHBOARD_TEST_ARTIFACTS", REPO / ".test-artifacts"))
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
GRAFANA = REPO / "infra" / "grafana" / "qworker.json"
RULES = REPO / "infra" / "prometheus" / "qworker-rules.yaml"


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    url = unique_url(redis_base_url(), "dash")
    logs = tmp_path_factory.mktemp("dash-workers")
    pool = Pool(url)
    try:
        for name in ("w1", "w2"):
            pool.workers[name] = spawn_fake_worker(url, name, INTERVAL_S, free_port(), logs)
        pool.logs = logs  # type: ignore[attr-defined]
        yield pool
    finally:
        pool.stop()
        cleanup(redis.Redis.from_url(redis_base_url()), url)


@pytest.fixture(scope="module")
def gateway(pool, tmp_path_factory):
    settings = GatewaySettings(files_url=str(tmp_path_factory.mktemp("dash-files")), batch_part_max_age_s=0.3)
    keys = ApiKeys({ADMIN_KEY: "admin", READ_KEY: "read"})
    app = create_app(
        settings,
        queue=pool.url,
        api_keys=keys,
        dashboard=DashboardSettings(history_interval_s=1.0, snapshot_ttl_s=0.1, stale_after_intervals=1.5),
    )
    with serve_app(app) as served:
        yield served


@pytest.fixture(scope="module")
def exporter(pool):
    from qworker.pool.demand import PoolSizing
    from qworker.pool.exporter import run_metrics_exporter

    stop = threading.Event()
    servers: list = []
    thread = threading.Thread(
        target=run_metrics_exporter,
        args=(pool.url, PoolSizing()),
        kwargs={
            "host": "127.0.0.1",
            "port": 0,
            "interval_s": 0.5,
            "stop": stop,
            "on_serving": servers.append,
        },
        daemon=True,
    )
    thread.start()
    deadline = time.monotonic() + 20
    while not servers and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{servers[0].port}/metrics"
    stop.set()
    thread.join(timeout=10)


def admin(gateway) -> httpx.Client:
    return httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)


def reader(gateway) -> httpx.Client:
    return httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {READ_KEY}"}, timeout=30)


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def redis_of(pool) -> redis.Redis:
    return redis.Redis.from_url(pool.url.split("?")[0])


def prefix_of(pool) -> str:
    return re.search(r"prefix=([^&]+)", pool.url).group(1)


# -- the JSON behind the page -------------------------------------------------------------------


def test_overview_json_matches_the_stats_reports_and_the_store(pool, gateway):
    r = redis_of(pool)
    prefix = prefix_of(pool)
    with admin(gateway) as http:
        data = wait_for(
            lambda: (
                (d := http.get("/dashboard/api/overview").json())["pool"]["totals"]["live_workers"] >= 2 and d
            ),
            what="two live workers",
        )
    by_id = {w["id"]: w for w in data["pool"]["workers"]}
    for name in ("w1", "w2"):
        stats = json.loads(r.get(f"{prefix}:worker:{name}"))
        view = by_id[name]
        admission, hardware = stats["admission"], stats["hardware"]
        assert view["state"] == "live"
        assert view["host"] == stats["host"] and view["pid"] == stats["pid"]
        assert view["pid"] == pool.workers[name].process.pid
        assert view["device"] == hardware["device"] == "cpu"
        assert view["device_name"] == hardware["device_name"]
        assert view["model"] == stats["model"] == "fake-tiny"
        assert view["dtype"] == hardware["dtype"] == "float32"
        assert view["quantization"] == stats["quantization"]
        assert view["adapters"] == stats["adapters"]
        assert view["kv_blocks_total"] == admission["num_total_blocks"] == 64
        # The report read a moment later may be a newer one: compare with its own fields.
        assert 0 <= view["kv_blocks_used"] <= 64
        assert view["report_interval_s"] == stats["report_interval_s"] == INTERVAL_S
        assert 0 <= view["report_age_s"] < 3 * INTERVAL_S
        assert view["num_running"] is not None and view["num_waiting"] is not None
        assert view["output_tokens_per_s"] is not None
    totals = data["pool"]["totals"]
    live = data["pool"]["workers"]
    assert totals["live_workers"] == len(live)
    assert totals["kv_blocks_total"] == sum(w["kv_blocks_total"] for w in live)
    assert totals["kv_blocks_used"] == sum(w["kv_blocks_used"] for w in live)
    queue = data["queues"][0]
    stream = stream_of(pool.url)
    assert queue["name"] == stream
    assert queue["dead_letters"] == r.xlen(f"{stream}:dead")
    assert {lane["kind"] for lane in queue["lanes"]} == {"priority", "shared"}
    assert queue["capacity_blocks"] == 64
    assert isinstance(data["history"], list)


def test_queue_depth_oldest_age_and_kv_demand_follow_the_queue(pool, gateway):
    """Jobs put on the queue's stream before any worker's group read: depth, blocks and age are the
    backlog reader's, per lane and in total."""
    stream = stream_of(pool.url)
    r = redis_of(pool)
    # 20 jobs of (5 prompt bytes + 40 tokens) = 12 blocks each (block size 16 by default sizing).
    with Client(queue=pool.url) as client:
        client.submit_many([{"prompt": "hello", "params": {"max_tokens": 40}} for _ in range(20)])
    with admin(gateway) as http:
        seen = wait_for(
            lambda: (
                (q := http.get("/dashboard/api/overview").json()["queues"][0])["depth"] + q["in_flight"] > 0
                and q
            ),
            what="the jobs in the queue",
        )
        assert seen["demand_blocks"] >= seen["waiting_blocks"] >= 0
        shared = next(lane for lane in seen["lanes"] if lane["kind"] == "shared")
        assert shared["name"] == stream
        if seen["depth"]:
            assert seen["oldest_waiting_age_s"] is not None and seen["oldest_waiting_age_s"] >= 0
        wait_for(lambda: r.xlen(stream) == 0, 60, "the jobs to finish")
        # The board's in-flight count comes from the pending entries, which the last acks empty
        # a moment after the stream is: wait for one snapshot with all three at zero.
        wait_for(
            lambda: (
                (q := http.get("/dashboard/api/overview").json()["queues"][0])["depth"] == 0
                and q["in_flight"] == 0
                and q["waiting_blocks"] == 0
            ),
            what="an empty queue with nothing in flight",
        )


def test_batch_and_job_json_match_the_board_and_the_result(pool, gateway):
    r = redis_of(pool)
    prefix = prefix_of(pool)
    board = batch_board.BatchBoard(r, prefix, "cli-batch-json", source="cli")
    board.start_run(total=3, done_before=0)

    class Line:
        def __init__(self, custom_id, error):
            self.custom_id = custom_id
            self.is_error = error is not None
            self.response = type("R", (), {"status_code": 400 if error else 200})()
            self.error = type("E", (), {"code": error, "message": f"{error} happened"})() if error else None

    board.observe_line(Line("a", None))
    board.observe_line(Line("b", "context_length_exceeded"))
    board.flush(force=True)
    with Client(queue=pool.url) as client:
        job_id = client.submit({"prompt": "json", "params": {"max_tokens": 5}})
        result = client.result(job_id, timeout=30)
    with admin(gateway) as http:
        data = http.get("/dashboard/api/batches/cli-batch-json").json()
        stored = json.loads(r.get(batch_board.board_key(prefix, "cli-batch-json")))
        b = data["batch"]
        for key in ("id", "source", "status", "total", "completed", "failed", "errors_by_code", "created_at"):
            assert b[key] == stored[key], key
        assert (b["done"], b["remaining"], b["status"]) == (2, 1, "in_progress")
        assert b["errors_by_code"] == {"context_length_exceeded": 1}
        assert data["failed_rows"]["total"] == 1
        row = data["failed_rows"]["items"][0]
        assert (row["custom_id"], row["code"], row["status_code"]) == ("b", "context_length_exceeded", 400)
        listed = http.get("/dashboard/api/overview").json()["batches"]
        assert "cli-batch-json" in [item["id"] for item in listed["items"]]
        job = http.get(f"/dashboard/api/jobs/{job_id}").json()
        assert job["found"] and job["status"] == result.status.value == "completed"
        assert job["result"]["worker"] == result.worker and job["result"]["attempts"] == result.attempts
        assert job["result"]["text"] == result.text
        assert job["result"]["timings"]["finished_at"] == result.timings.finished_at
        unknown = http.get("/dashboard/api/jobs/no-such-job").json()
        assert unknown["found"] is False and unknown["result"] is None
        assert http.get("/dashboard/api/batches/no-such-batch").status_code == 404


# -- auth, roles, actions -----------------------------------------------------------------------


def test_no_key_is_401_and_a_browser_is_asked_for_one(gateway):
    for path in ("/dashboard", "/dashboard/api/overview", "/dashboard/static/dashboard.js"):
        response = httpx.get(gateway.url + path)
        assert response.status_code == 401, path
        assert response.headers["www-authenticate"].startswith("Basic")
    assert httpx.get(gateway.url + "/dashboard", auth=("any", "wrong")).status_code == 401
    page = httpx.get(gateway.url + "/dashboard", auth=("any", READ_KEY))
    assert page.status_code == 200 and "dashboard.js" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    # Basic auth is the dashboard's alone: the API takes Bearer keys only.
    assert httpx.get(gateway.url + "/v1/models", auth=("any", ADMIN_KEY)).status_code == 401


def test_roles_read_sees_no_actions_and_no_api(pool, gateway):
    with reader(gateway) as http:
        session = http.get("/dashboard/api/session").json()
        assert session == {"role": "read", "can_act": False, "csrf_token": None, "refresh_ms": 1000}
        assert http.get("/dashboard/api/overview").status_code == 200
        assert http.get("/metrics").status_code == 200
        assert http.get("/v1/models").status_code == 403
        refused = http.post("/dashboard/api/dead-letters/purge", json={"confirm": "purge"})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    with admin(gateway) as http:
        assert http.get("/v1/models").status_code == 200


def test_actions_check_the_method_the_csrf_token_and_the_origin(pool, gateway):
    with admin(gateway) as http:
        token = http.get("/dashboard/api/session").json()["csrf_token"]
        assert http.get("/dashboard/api/dead-letters/purge").status_code == 405
        assert http.post("/dashboard/api/dead-letters/purge", json={"confirm": "purge"}).status_code == 403
        wrong = http.post(
            "/dashboard/api/dead-letters/purge", json={"confirm": "purge"}, headers={"X-CSRF-Token": "0" * 64}
        )
        assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "csrf_failed"
        other = http.post(
            "/dashboard/api/dead-letters/purge",
            json={"confirm": "purge"},
            headers={"X-CSRF-Token": token, "Origin": "https://evil.example"},
        )
        assert other.status_code == 403
        unconfirmed = http.post("/dashboard/api/dead-letters/purge", json={}, headers={"X-CSRF-Token": token})
        assert unconfirmed.status_code == 400
        bad_ids = http.post(
            "/dashboard/api/dead-letters/replay", json={"ids": "x"}, headers={"X-CSRF-Token": token}
        )
        assert bad_ids.status_code == 400


# -- metrics named by Grafana and the alert rules ---------------------------------------------


def _exported_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)
            if kind == "counter":
                names.add(name + "_total")
            if kind in ("histogram", "summary"):
                names |= {name + s for s in ("_bucket", "_sum", "_count")}
            if kind == "info":
                names.add(name + "_info")
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def _named_metrics() -> set[str]:
    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    exprs += re.findall(r"expr:\s*(.+)", RULES.read_text())
    return {name for expr in exprs for name in re.findall(r"\bqworker_[a-z0-9_]+", expr)}


def test_every_metric_grafana_and_the_rules_name_is_exported(pool, gateway, exporter):
    with admin(gateway) as http:
        http.get("/dashboard/api/overview")
        texts = [http.get("/metrics").text]
    texts += [
        httpx.get(f"http://127.0.0.1:{w.metrics_port}/metrics").text
        for w in pool.workers.values()
        if w.process.poll() is None
    ]
    texts.append(
        wait_for(
            lambda: (t := httpx.get(exporter).text) and "qworker_pool_dead_letters " in t and t,
            what="the exporter's gauges",
        )
    )
    exported = set().union(*(_exported_names(t) for t in texts))
    named = _named_metrics()
    assert len(named) >= 10
    assert named <= exported, f"named but not exported: {sorted(named - exported)}"


# -- the browser ----------------------------------------------------------------------------------


def _browser():
    playwright_api = pytest.importorskip(
        "playwright.sync_api", reason="pip install playwright (the dev extra)"
    )
    if not Path(CHROMIUM).exists():
        pytest.skip("no /usr/bin/chromium: apt-get install chromium (docs/operations.md)")
    return playwright_api


def _batch_file(tmp_path: Path) -> Path:
    lines = []
    for i in range(6):
        body = {"model": "smollm2", "messages": [{"role": "user", "content": f"row {i}"}], "max_tokens": 12}
        if i == 5:
            body["temperature"] = -1  # refused at parse: a failed row with its code
        lines.append(
            json.dumps(
                {"custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            )
        )
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_page_in_a_real_browser(pool, gateway, tmp_path):
    api = _browser()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    r = redis_of(pool)
    prefix = prefix_of(pool)
    sdk = openai.OpenAI(base_url=gateway.base_url, api_key=ADMIN_KEY, max_retries=0, timeout=30)
    # Hostile ids: a worker report and a batch whose names are markup.
    hostile_worker = '<img src=x onerror="window.__pwned=1">'
    hostile_batch = "<script>window.__pwned=2</script>"
    hostile_report = json.loads(r.get(f"{prefix}:worker:w1"))
    hostile_report["reported_at"] = time.time() + 3600  # live for the whole test
    r.set(f"{prefix}:worker:{hostile_worker}", json.dumps(hostile_report), ex=120)
    batch_board.BatchBoard(r, prefix, hostile_batch, source="cli").set_status("in_progress")

    with api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            context = browser.new_context(
                http_credentials={"username": "ops", "password": ADMIN_KEY},
                viewport={"width": 1400, "height": 1000},
            )
            page = context.new_page()
            dialogs: list[str] = []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.accept()))
            page.goto(gateway.url + "/dashboard")
            live = 'tr[data-testid="worker"][data-state="live"]'
            page.wait_for_selector(f'{live}[data-worker-id="w1"]')
            page.wait_for_selector(f'{live}[data-worker-id="w2"]')
            kv = page.locator(f'{live}[data-worker-id="w1"] [data-testid="kv-text"]').inner_text()
            assert re.fullmatch(r"\d+ / 64", kv), kv
            # Markup in ids is text: the hostile worker's row shows its name, and nothing ran.
            assert page.locator('tr[data-testid="worker"]', has_text="<img src=x").count() == 1
            page.wait_for_selector('tr[data-testid="batch"]', state="attached")
            assert page.locator('tr[data-testid="batch"]', has_text="<script>").count() == 1
            assert page.evaluate("window.__pwned") is None
            assert not dialogs

            # SIGKILL w2: stopped within two report intervals plus a second.
            killed_at = time.monotonic()
            pool.workers["w2"].kill()
            page.wait_for_selector('tr[data-testid="stopped-worker"][data-worker-id="w2"]', timeout=10_000)
            took = time.monotonic() - killed_at
            assert took <= 2 * INTERVAL_S + 1.0, f"marked stopped after {took:.2f} s"
            # A third worker appears without a reload.
            pool.workers["w3"] = spawn_fake_worker(pool.url, "w3", INTERVAL_S, free_port(), pool.logs)
            page.wait_for_selector(f'{live}[data-worker-id="w3"]', timeout=15_000)

            # Enqueued jobs move the depth.
            with Client(queue=pool.url) as client:
                client.submit_many([{"prompt": "depth", "params": {"max_tokens": 60}} for _ in range(40)])
            page.wait_for_function(
                "() => Number((document.querySelector('[data-testid=queue-depth]') || {}).textContent"
                " || 0) > 0",
                timeout=10_000,
            )

            # A batch through the Batches API: 100% and completed, its failed row on its page.
            uploaded = sdk.files.create(file=_batch_file(tmp_path).open("rb"), purpose="batch")
            batch = sdk.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            row = f'tr[data-testid="batch"][data-batch-id="{batch.id}"]'
            page.wait_for_selector(f'{row}[data-status="completed"]', timeout=60_000)
            assert page.locator(f'{row} [data-testid="batch-percent"]').inner_text() == "100%"
            assert (
                page.locator(f'{row} [data-testid="batch-progress"]').get_attribute("data-progress") == "100"
            )
            page.screenshot(path=str(ARTIFACTS / "dashboard-pool.png"), full_page=True)
            page.goto(gateway.url + f"/dashboard#/batch/{batch.id}")
            page.wait_for_selector('tr[data-testid="failed-row"][data-custom-id="row-5"]')
            assert "invalid" in page.locator('tr[data-testid="failed-row"]').inner_text()
            page.screenshot(path=str(ARTIFACTS / "dashboard-batch.png"), full_page=True)

            # A dead letter shows its reason; replay from the page runs the job.
            job_id = "dlq-" + os.urandom(4).hex()
            letter = make_dead_letter(
                pool.url,
                {"id": job_id, "prompt": "again", "params": {"max_tokens": 3}},
                "poisoned: delivered 4 times",
            )
            page.goto(gateway.url + "/dashboard#/dead-letters")
            letter_row = page.locator(f'tr[data-testid="dead-letter"][data-letter-id="{letter}"]')
            letter_row.wait_for()
            assert (
                "poisoned: delivered 4 times"
                in letter_row.locator('[data-testid="dead-letter-reason"]').inner_text()
            )
            letter_row.locator('[data-testid="replay"]').click()
            with Client(queue=pool.url) as client:
                assert client.result(job_id, timeout=30).status.value == "completed"
            letter_row.wait_for(state="detached", timeout=10_000)
            assert any("Replay" in d for d in dialogs)

            # A read-only key sees the letter but no replay button.
            second = make_dead_letter(pool.url, {"id": job_id + "-b", "prompt": "x"}, "second reason")
            read_context = browser.new_context(http_credentials={"username": "ops", "password": READ_KEY})
            read_page = read_context.new_page()
            read_page.goto(gateway.url + "/dashboard#/dead-letters")
            read_page.wait_for_selector(f'tr[data-testid="dead-letter"][data-letter-id="{second}"]')
            assert read_page.locator('[data-testid="replay"]').count() == 0
            assert read_page.locator('[data-testid="purge"]').count() == 0
            assert "read only" in read_page.locator('[data-testid="role"]').inner_text()
            refused = read_page.evaluate(
                """async () => (await fetch('/dashboard/api/dead-letters/replay', {
                    method: 'POST', headers: {'Content-Type': 'application/json'},
                    body: JSON.stringify({all: true})})).status"""
            )
            assert refused == 403
            assert page.evaluate("window.__pwned") is None
        finally:
            browser.close()

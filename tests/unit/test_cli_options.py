"""`qworker worker` options come from EngineConfig and WorkerSettings: every field is an option that
reaches the built config, --help shows every name in full at any width, `python -m qworker` is the
command, the README's configuration tables match the options, and --scheduling-policy changes the
order in which a real worker starts jobs."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import typing
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from qworker import cli
from qworker.cli_options import config_to_args, engine_options
from qworker.config import DEPRECATED_FIELDS, EngineConfig, SchedulingPolicy
from qworker.worker.settings import LOG_PAYLOADS_ENV, WorkerSettings

REPO = Path(__file__).resolve().parents[2]
CONFIG_CLASSES = (EngineConfig, WorkerSettings)
# Options of `qworker worker` that are not config fields (kept by name for docs, infra and tests).
RUN_OPTIONS = ("--queue", "--results", "--stream-results", "--lease-timeout-s", "--burst", "--log-level")
# Fields whose other value must be one the dataclass accepts.
OTHER_VALUES = {
    "attention_backend": "torch",
    "dtype": "float16",
    "gpu_memory_utilization": 0.5,
    # At least max_loras (1 + 3 = 4), as EngineConfig requires.
    "max_cpu_loras": 8,
    "lora_modules": "tuned=/adapters/tuned",
}


def flag(name: str) -> str:
    # Spelled out here, not taken from qworker.cli_options, so that the test checks the generator.
    return "--" + name.replace("_", "-")


def field_type(cls: type, field: dataclasses.Field) -> type:
    hint = typing.get_type_hints(cls)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def default_of(field: dataclasses.Field) -> Any:
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def other_value(cls: type, field: dataclasses.Field) -> Any:
    """A value different from the field's default, of its type."""
    if field.name in OTHER_VALUES:
        return OTHER_VALUES[field.name]
    default = default_of(field)
    kind = field_type(cls, field)
    if kind is bool:
        return not default
    if kind is int:
        return (default or 0) + 3
    if kind is float:
        return (default or 0.0) + 1.5
    if kind is str:
        return f"{field.name}-x"
    assert issubclass(kind, Enum), f"{cls.__name__}.{field.name}: no test value for {kind}"
    return next(member for member in kind if member != default)


def as_args(name: str, value: Any) -> list[str]:
    if isinstance(value, bool):
        return [flag(name) if value else "--no-" + flag(name)[2:]]
    return [flag(name), str(value.value if isinstance(value, Enum) else value)]


@pytest.fixture
def invoke(monkeypatch):
    """Run `qworker worker ARGS` through typer; return what it would serve with (no model, no queue)."""
    monkeypatch.delenv(LOG_PAYLOADS_ENV, raising=False)
    served: list[tuple[EngineConfig, WorkerSettings, cli.WorkerRun]] = []
    monkeypatch.setattr(
        cli, "serve_worker", lambda engine, settings, run: served.append((engine, settings, run))
    )

    def run(*args: str) -> tuple[EngineConfig, WorkerSettings, cli.WorkerRun]:
        result = CliRunner().invoke(cli.app, ["worker", *args])
        assert result.exit_code == 0, (
            f"qworker worker {' '.join(args)}: exit {result.exit_code}\n{result.output}"
        )
        assert len(served) == 1
        return served.pop()

    return run


def test_every_config_field_is_a_worker_option_that_reaches_the_config(invoke):
    args: list[str] = []
    expected: dict[str, dict[str, Any]] = {}
    for cls in CONFIG_CLASSES:
        expected[cls.__name__] = {}
        for field in dataclasses.fields(cls):
            if field.name in DEPRECATED_FIELDS:
                continue  # an alias of a field set here: not both (test_deprecated_kv_cache_memory_gb)
            value = other_value(cls, field)
            expected[cls.__name__][field.name] = value
            args += as_args(field.name, value)
    engine_config, settings, _ = invoke(*args)
    for cls, built in ((EngineConfig, engine_config), (WorkerSettings, settings)):
        assert isinstance(built, cls)
        for name, value in expected[cls.__name__].items():
            assert getattr(built, name) == value, (
                f"{flag(name)} {value!r} gave {name}={getattr(built, name)!r}"
            )


def test_no_options_give_the_dataclass_defaults(invoke):
    engine_config, settings, run = invoke()
    assert engine_config == EngineConfig()
    assert engine_config.scheduling_policy is SchedulingPolicy.FCFS
    defaults = dataclasses.asdict(WorkerSettings())
    built = dataclasses.asdict(settings)
    assert built.pop("name") and defaults.pop("name")  # a fresh name per process
    assert built == defaults
    assert run == cli.WorkerRun(None, None, None, None, False, "INFO")


def test_run_options_keep_their_names(invoke):
    _, _, run = invoke(
        "--queue", "redis://q", "--results", "s3://b/r", "--stream-results", "redis://s",
        "--lease-timeout-s", "7.5", "--burst", "--log-level", "DEBUG",
    )  # fmt: skip
    assert run == cli.WorkerRun("redis://q", "s3://b/r", "redis://s", 7.5, True, "DEBUG")


def test_bools_negate_and_enums_are_choices(invoke):
    engine_config, settings, _ = invoke("--no-enable-chunked-prefill", "--log-payloads", "--enforce-eager")
    assert engine_config.enable_chunked_prefill is False
    assert engine_config.enforce_eager is True
    assert settings.log_payloads is True
    result = CliRunner().invoke(cli.app, ["worker", "--scheduling-policy", "lifo"])
    assert result.exit_code == 2
    assert "fcfs" in result.output and "priority" in result.output


def test_log_payloads_default_comes_from_the_environment(invoke, monkeypatch):
    monkeypatch.setenv(LOG_PAYLOADS_ENV, "1")
    assert invoke()[1].log_payloads is True
    assert invoke("--no-log-payloads")[1].log_payloads is False


def test_invalid_values_are_usage_errors_not_tracebacks():
    result = CliRunner().invoke(cli.app, ["worker", "--block-size", "0"])
    assert result.exit_code == 2
    assert "block_size must be >= 1" in result.output


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_gpu_memory_utilization_is_a_fraction_in_zero_one(value):
    result = CliRunner().invoke(cli.app, ["worker", "--gpu-memory-utilization", value])
    assert result.exit_code == 2
    assert "gpu_memory_utilization must be in (0, 1]" in result.output


def test_deprecated_kv_cache_memory_gb_becomes_bytes(invoke):
    with pytest.warns(DeprecationWarning, match="kv_cache_memory_bytes=536870912"):
        engine_config, _, _ = invoke("--kv-cache-memory-gb", "0.5")
    assert (engine_config.kv_cache_memory_bytes, engine_config.kv_cache_memory_gb) == (2**29, None)
    assert engine_config == EngineConfig(kv_cache_memory_bytes=2**29)
    both = ["worker", "--kv-cache-memory-gb", "0.5", "--kv-cache-memory-bytes", "1024"]
    result = CliRunner().invoke(cli.app, both)
    assert result.exit_code == 2
    assert "not both" in result.output


def test_config_to_args_round_trips_through_the_command(invoke):
    engine_config = EngineConfig(
        model="m", block_size=8, kv_cache_memory_bytes=2**29, gpu_memory_utilization=0.75,
        enable_chunked_prefill=False,
        scheduling_policy=SchedulingPolicy.PRIORITY, attention_backend="torch", seed=7,
    )  # fmt: skip
    settings = WorkerSettings(name="w1", max_backlog=3, lease_extend_interval_s=2.0, log_payloads=False)
    args = config_to_args(engine_config) + config_to_args(settings)
    assert "--block-size" in args and "--max-num-seqs" not in args  # defaults are left out
    built_engine, built_settings, _ = invoke(*args)
    assert built_engine == engine_config
    assert built_settings == settings


def test_overrides_mode_gives_only_what_was_given():
    """The API for commands that pass engine settings on (qworker bench)."""
    # A command parameter with a field's name (bench's own --seed) is refused, not shadowed.
    with pytest.raises(TypeError, match="clash"):

        @engine_options(into="overrides", only=("seed",), as_overrides=True)
        def clashing(seed: int = 0, *, overrides: dict[str, Any]) -> None: ...

    app = typer.Typer(rich_markup_mode=None)
    seen: list[dict[str, Any]] = []

    @app.command()
    @engine_options(into="overrides", only=("block_size", "enable_chunked_prefill"), as_overrides=True)
    def run(*, overrides: dict[str, Any]) -> None:
        seen.append(overrides)

    runner = CliRunner()
    assert runner.invoke(app, []).exit_code == 0
    assert runner.invoke(app, ["--block-size", "32", "--no-enable-chunked-prefill"]).exit_code == 0
    assert runner.invoke(app, ["--block-size", "0"]).exit_code == 2
    assert seen == [{}, {"block_size": 32, "enable_chunked_prefill": False}]
    help_text = runner.invoke(app, ["--help"]).output
    # The dataclass default is shown (click puts a described default in parentheses), though the
    # option's own default is None.
    assert "[default: (16)]" in help_text and "[default: (true)]" in help_text


def _run_qworker(*args: str, columns: int = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(columns), "OMP_NUM_THREADS": "1"}
    env.pop("TERMINAL_WIDTH", None)
    # stdout is a pipe, not a terminal: what typer's rich output used to cut at 80 columns.
    return subprocess.run(
        [sys.executable, "-m", "qworker", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=REPO,
    )


def test_help_shows_every_option_name_in_full_on_a_narrow_pipe():
    result = _run_qworker("worker", "--help", columns=60)
    assert result.returncode == 0, result.stderr
    names = [*RUN_OPTIONS]
    for cls in CONFIG_CLASSES:
        for field in dataclasses.fields(cls):
            names.append(flag(field.name))
            if field_type(cls, field) is bool:
                names.append("--no-" + flag(field.name)[2:])
    words = set(re.findall(r"--[a-z][a-z0-9-]*", result.stdout))
    missing = [name for name in names if name not in words]
    assert not missing, f"cut or missing in `qworker worker --help`: {missing}\n{result.stdout}"
    assert "fcfs|priority" in result.stdout


def test_python_dash_m_qworker_is_the_command():
    result = _run_qworker("--help")
    assert result.returncode == 0, result.stderr
    for command in ("worker", "submit", "demo", "bench"):
        assert re.search(rf"^\s+{command}\s", result.stdout, flags=re.MULTILINE), result.stdout


def test_a_broken_bench_import_is_an_error():
    code = "import sys; sys.modules['qworker.bench.command'] = None; import qworker.cli"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode != 0
    assert "qworker.bench.command" in result.stderr


# -- the README's configuration tables ----------------------------------------------------------


def _readme_tables() -> tuple[dict[str, str], dict[str, str]]:
    """(engine rows, worker rows) of the README's Configuration section: option -> default cell."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Configuration\n", 1)[1].split("\n## ", 1)[0]
    tables: list[dict[str, str]] = []
    rows: dict[str, str] | None = None
    for line in section.splitlines():
        if line.startswith("| option |"):
            rows = {}
            tables.append(rows)
        elif line.startswith("|") and rows is not None and not line.startswith("|---"):
            option, default = (cell.strip() for cell in line.strip("|").split("|")[:2])
            rows[option.strip("`")] = default
        elif not line.startswith("|"):
            rows = None
    assert len(tables) == 2, f"expected an engine and a worker table, found {len(tables)}"
    return tables[0], tables[1]


def _parse_default(cell: str, real: Any) -> Any:
    token = cell.split()[0].strip("`")
    if token == "none":
        return None
    if isinstance(real, bool):
        return {"true": True, "on": True, "false": False, "off": False}[token]
    if isinstance(real, int | float):
        return float(token)
    return token


def test_readme_configuration_tables_match_the_options():
    command = typer.main.get_command(cli.app).commands["worker"]
    params = {opt: param for param in command.params for opt in param.opts}
    engine_rows, worker_rows = _readme_tables()
    factory_fields = {
        flag(f.name)
        for cls in CONFIG_CLASSES
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING
    }
    rows = {flag(name): cell for name, cell in engine_rows.items()} | worker_rows
    for option, cell in rows.items():
        assert option in params, f"README lists {option}, which `qworker worker` does not have"
        if option in factory_fields:
            continue  # computed per process (a fresh name; the environment): the cell says how
        real = params[option].default
        assert _parse_default(cell, real) == real, (
            f"README: {option} default {cell!r}, the option's is {real!r}"
        )
    assert set(engine_rows) == {f.name for f in dataclasses.fields(EngineConfig)}, (
        "engine table != EngineConfig"
    )
    worker_fields = {flag(f.name) for f in dataclasses.fields(WorkerSettings)}
    assert worker_fields <= set(worker_rows), f"worker table lacks {sorted(worker_fields - set(worker_rows))}"


# -- end to end: --scheduling-policy on a real worker ---------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from qworker.testing.worker_kit import write_tiny_model_dir

    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-cli"))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_scheduling_policy_orders_a_real_workers_jobs(policy, tiny_model_dir, tmp_path):
    import redis

    from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
    from qworker.jobs.client import Client
    from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url

    url = unique_url(redis_base_url(), "cli-policy")
    job = {
        "prompt_token_ids": [5, 6, 7, 8],
        "params": {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True},
    }
    try:
        # Every job is queued before the worker starts, and --max-backlog holds them all, so the
        # engine chooses among all eleven at its first step; one runs at a time (--max-num-seqs 1).
        with Client(queue=url) as client:
            background = [client.submit({**job, "priority": 5}) for _ in range(10)]
            urgent = client.submit({**job, "priority": 0})
            log_path = tmp_path / "worker.log"
            command = [
                sys.executable,
                "-m",
                "qworker",
                "worker",
                "--queue",
                url,
                "--model",
                str(tiny_model_dir),
            ]
            command += ["--scheduling-policy", policy, "--max-num-seqs", "1", "--max-backlog", "16"]
            command += ["--num-kv-blocks", "64", "--dtype", "float32", "--device", "cpu", "--burst"]
            with open(log_path, "w") as log:
                process = subprocess.run(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                    timeout=180,
                    cwd=REPO,
                )
            assert process.returncode == 0, log_path.read_text()[-3000:]
            results = {job_id: client.result(job_id, timeout=10) for job_id in [*background, urgent]}
    finally:
        cleanup(redis.Redis.from_url(parse_url(url, SOURCE_PARAMS | SINK_PARAMS).connection_url), url)
    for result in results.values():
        assert result.status.value == "completed", result
    started = {job_id: result.timings.started_at for job_id, result in results.items()}
    first = min(started, key=started.__getitem__)
    last = max(started, key=started.__getitem__)
    if policy == "priority":
        assert first == urgent, f"the priority-0 job started at {started[urgent]}, not first: {started}"
    else:
        assert last == urgent, (
            f"fcfs: the last job submitted started at {started[urgent]}, not last: {started}"
        )

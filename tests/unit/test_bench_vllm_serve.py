"""The `vllm serve` twin of the vllm-cpu system: built for http mode from the same spec, with the
same options as `vllm serve` flags; without a vLLM venv it is skipped with a note. (Running it
needs vLLM's CPU build: scripts/setup_vllm_cpu.sh; the figures are in docs/BENCHMARKS.md.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from qworker.bench.command import _build_systems
from qworker.bench.registry import BenchSettings, parse_systems
from qworker.bench.vllm_serve import VllmServeSystem, serve_flags

pytestmark = pytest.mark.timeout(60)


def test_engine_options_become_serve_flags() -> None:
    flags = serve_flags({"max_num_seqs": 64, "enable_chunked_prefill": False, "enable_prefix_caching": True})
    assert flags == ["--max-num-seqs", "64", "--no-enable-chunked-prefill", "--enable-prefix-caching"]


def fake_root(tmp_path: Path) -> Path:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    return tmp_path


def test_http_mode_builds_vllm_serve_with_the_spec_options(tmp_path: Path) -> None:
    root = fake_root(tmp_path)
    specs = parse_systems(f"vllm-cpu:max_num_seqs=32:bind=default:kv_cache_gb=2:root={root}")
    systems, notes = _build_systems(specs, ["http"], BenchSettings(dtype="float32"), tmp_path, None, False)
    [system] = systems
    assert isinstance(system, VllmServeSystem) and system.mode == "http" and not notes
    command = system.command(port=18602)
    assert command[0] == str(root / "venv" / "bin" / "python") and command[2] == "serve"
    assert Path(command[1]).name == "vllm_serve_driver.py" and Path(command[1]).exists()
    assert command[command.index("--port") + 1] == "18602"
    assert command[command.index("--dtype") + 1] == "float32"
    assert command[command.index("--max-num-seqs") + 1] == "32"
    assert system.kv_cache_gb == 2 and system.bind == "default"


def test_without_a_vllm_venv_http_mode_skips_it_with_a_note(tmp_path: Path) -> None:
    specs = parse_systems(f"vllm-cpu:root={tmp_path / 'none'}")
    systems, notes = _build_systems(specs, ["http"], BenchSettings(), tmp_path, None, False)
    assert systems == [] and "no vLLM CPU venv" in notes[0]

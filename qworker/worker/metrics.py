"""Prometheus metrics of one worker: what the loop observes, in Prometheus' conventions (names
`qworker_*`, the unit in the name, `_total` on counters, seconds for time).

Every metric lives on this object's own CollectorRegistry, not on prometheus_client's global one:
two workers in one process (tests, the demo) keep separate counts, and the endpoint serves only
qworker's metrics. Updating them is cheap (a lock and an add); the loop calls the gauge setter once
per housekeeping pass, the rest once per job or per step.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from qworker.jobs.job import JobResult, JobStatus
from qworker.startup import HardwareInfo, StartupTimings

if TYPE_CHECKING:
    from qworker.engine.block_pool import KVCacheStats
    from qworker.worker.admission import AdmissionStats

# Seconds. LLM jobs on these machines take from tens of milliseconds (a short decode on a GPU) to
# many minutes (a long generation on 2 CPU cores behind a backlog).
LATENCY_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1200.0,
    1800.0,
    3600.0,
)
# Seconds between two tokens of one job: one engine step, from about 1 ms (GPU decode) to seconds
# (a CPU step that also prefills a long prompt).
INTER_TOKEN_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)


class WorkerMetrics:
    """The metrics of one worker, on their own registry (serve `registry` at /metrics)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.info = Info("qworker_worker", "The model and runtime this worker serves", registry=r)
        # Set once at start (set_hardware, set_startup): what this worker's KV pool means in a
        # pool of different devices or block sizes, and what its start cost.
        self.hardware_info = Info("qworker_hardware", "The device this worker serves on", registry=r)
        self.device_memory_bytes = Gauge(
            "qworker_device_memory_bytes", "Memory of the device (GPU; for a CPU, the machine's)", registry=r
        )
        self.kv_capacity_tokens = Gauge(
            "qworker_kv_cache_capacity_tokens", "Tokens the KV cache holds: blocks x block size", registry=r
        )
        self.kv_block_size_tokens = Gauge(
            "qworker_kv_cache_block_size_tokens", "Tokens per KV block", registry=r
        )
        self.startup_seconds = Gauge(
            "qworker_startup_seconds",
            "Time to ready by phase (qworker/startup.py); phase=total from the process start",
            ["phase"],
            registry=r,
        )

        # Engine and worker state: set by set_engine_gauges.
        self.requests_running = Gauge(
            "qworker_requests_running", "Requests in the engine's running batch", registry=r
        )
        self.requests_waiting = Gauge(
            "qworker_requests_waiting", "Requests added to the engine and not yet scheduled", registry=r
        )
        self.jobs_held = Gauge(
            "qworker_jobs_held", "Jobs this worker holds a lease on (running or in its backlog)", registry=r
        )
        self.kv_total_blocks = Gauge(
            "qworker_kv_cache_total_blocks", "Blocks in the engine's paged KV cache", registry=r
        )
        self.kv_free_blocks = Gauge("qworker_kv_cache_free_blocks", "KV-cache blocks free", registry=r)
        self.kv_cached_blocks = Gauge(
            "qworker_kv_cache_cached_blocks",
            "KV-cache blocks that hold a finished request's prefix and can be evicted (0 without "
            "prefix caching)",
            registry=r,
        )
        self.kv_usage = Gauge(
            "qworker_kv_cache_usage_ratio", "Used KV-cache blocks over all blocks, 0 to 1", registry=r
        )
        self.headroom_blocks = Gauge(
            "qworker_admission_headroom_blocks",
            "Free KV blocks left after reserving growth for running jobs and prompts for held ones",
            registry=r,
        )

        # Counters (prometheus_client adds the _total suffix).
        self.jobs = Counter(
            "qworker_jobs", "Jobs that ended with a stored result, by status", ["status"], registry=r
        )
        self.dead_lettered = Counter(
            "qworker_dead_lettered_jobs",
            "Messages moved to the dead-letter queue, by reason",
            ["reason"],
            registry=r,
        )
        self.leases_lost = Counter(
            "qworker_leases_lost", "Held jobs whose lease a peer took over (dropped here)", registry=r
        )
        self.jobs_released = Counter(
            "qworker_released_jobs", "Held jobs given back to the queue unfinished (drain)", registry=r
        )
        self.prompt_tokens = Counter(
            "qworker_prompt_tokens", "Prompt tokens of jobs that reached the engine", registry=r
        )
        self.generation_tokens = Counter("qworker_generation_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter(
            "qworker_preemptions", "Requests preempted (blocks freed, recomputed later)", registry=r
        )
        self.engine_steps = Counter("qworker_engine_steps", "Engine steps run", registry=r)
        # LoRA adapters (docs/lora.md): what a pool's adapter affinity saves shows in the first.
        self.lora_adapter_loads = Counter(
            "qworker_lora_adapter_loads",
            "LoRA adapters read from their files into host memory (misses of max_cpu_loras)",
            registry=r,
        )
        self.lora_slot_loads = Counter(
            "qworker_lora_slot_loads",
            "LoRA adapters copied from host memory into a device slot (misses of max_loras)",
            registry=r,
        )
        # Resume from tokens (docs/queues.md): redelivered jobs by what their checkpoint allowed,
        # and the tokens they resumed from, prefilled again here rather than generated (counted
        # apart from qworker_generation_tokens, which counts each token once, where generated).
        self.resumes = Counter(
            "qworker_resumes",
            "Redelivered jobs by outcome: resumed from their stored tokens, or restarted from zero "
            "because the tokens did not fit (another model, max_model_len, corrupt)",
            ["outcome"],
            registry=r,
        )
        self.resumed_tokens = Counter(
            "qworker_resumed_tokens",
            "Output tokens of earlier attempts that resumed jobs continued from (prefilled again, "
            "not generated)",
            registry=r,
        )

        # Latency histograms, in seconds.
        self.queue_wait = Histogram(
            "qworker_queue_wait_seconds",
            "From enqueue to the engine's first scheduling of the job",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.ttft = Histogram(
            "qworker_time_to_first_token_seconds",
            "From enqueue to the first generated token",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.itl = Histogram(
            "qworker_inter_token_latency_seconds",
            "Between consecutive tokens of one job",
            buckets=INTER_TOKEN_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "qworker_e2e_latency_seconds",
            "From enqueue to the stored result",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        # Every status shows from the start (0), so that rate() and the sum over statuses work
        # before the first failure.
        for status in JobStatus:
            self.jobs.labels(status=status.value)
        self._seen_adapter_loads = (0, 0)

    def set_hardware(self, hardware: HardwareInfo) -> None:
        self.hardware_info.info(
            {
                "device": hardware.device,
                "device_name": hardware.device_name,
                "dtype": hardware.dtype,
                "block_size": str(hardware.block_size),
                "cuda_graphs": "true" if hardware.is_cuda_graphs_enabled else "false",
            }
        )
        self.device_memory_bytes.set(hardware.device_memory_bytes)
        self.kv_capacity_tokens.set(hardware.kv_capacity_tokens)
        self.kv_block_size_tokens.set(hardware.block_size)

    def set_startup(self, timings: StartupTimings) -> None:
        for phase, seconds in timings.seconds.items():
            self.startup_seconds.labels(phase=phase).set(seconds)
        if timings.to_ready_s is not None:
            self.startup_seconds.labels(phase="total").set(timings.to_ready_s)

    def set_info(self, *, model: str, dtype: str, device: str, quantization: str | None = None) -> None:
        self.info.info(
            {
                "model": model,
                "dtype": dtype,
                "device": device,
                "quantization": quantization or "none",
                "version": installed_version(),
            }
        )

    def set_engine_gauges(
        self,
        kv: KVCacheStats,
        *,
        num_running: int,
        num_waiting: int,
        num_held: int,
        headroom_blocks: int,
        num_cached_blocks: int = 0,
    ) -> None:
        self.requests_running.set(num_running)
        self.requests_waiting.set(num_waiting)
        self.jobs_held.set(num_held)
        self.kv_total_blocks.set(kv.num_total_blocks)
        self.kv_free_blocks.set(kv.num_free_blocks)
        self.kv_cached_blocks.set(num_cached_blocks)
        self.kv_usage.set(kv.usage)
        self.headroom_blocks.set(headroom_blocks)

    def set_admission_gauges(self, kv: KVCacheStats, admission: AdmissionStats) -> None:
        """The gauges as the worker sees its jobs: one runs once it produced a token, and waits in
        the engine before that (queued or still prefilling)."""
        num_waiting = admission.num_jobs_not_started
        self.set_engine_gauges(
            kv,
            num_running=admission.num_jobs_held - num_waiting,
            num_waiting=num_waiting,
            num_held=admission.num_jobs_held,
            headroom_blocks=admission.num_headroom_blocks,
            num_cached_blocks=kv.num_cached_blocks,
        )

    def observe_result(self, result: JobResult) -> None:
        """One stored result: its status and its latencies (each one the job reached). Its tokens
        were counted as they were computed (observe_prompt_tokens, observe_generated_tokens)."""
        self.jobs.labels(status=result.status.value).inc()
        t = result.timings
        if t.enqueued_at is None:
            return
        if t.started_at is not None:
            self.observe_queue_wait(t.started_at - t.enqueued_at)
        if t.first_token_at is not None:
            self.observe_ttft(t.first_token_at - t.enqueued_at)
        if t.finished_at is not None:
            self.observe_e2e(t.finished_at - t.enqueued_at)

    def observe_prompt_tokens(self, num_tokens: int) -> None:
        """A job's prompt entered the engine (counted then, whatever becomes of the job)."""
        if num_tokens:
            self.prompt_tokens.inc(num_tokens)

    def observe_generated_tokens(self, num_tokens: int) -> None:
        """Tokens generated in one engine step (or the rest of a job's, at its end)."""
        if num_tokens:
            self.generation_tokens.inc(num_tokens)

    def observe_dead_letter(self, reason: str) -> None:
        """`reason` is a kind from a short fixed set (an error type such as "DeadLettered",
        "Rejected", "Unreadable"), never a message: every label value is a new time series."""
        self.dead_lettered.labels(reason=reason).inc()

    def observe_lease_lost(self, num_jobs: int = 1) -> None:
        self.leases_lost.inc(num_jobs)

    def observe_released(self, num_jobs: int) -> None:
        self.jobs_released.inc(num_jobs)

    def observe_preemptions(self, num_preemptions: int) -> None:
        if num_preemptions:
            self.preemptions.inc(num_preemptions)

    def observe_resume(self, num_tokens: int | None) -> None:
        """A redelivered job with stored tokens: resumed from `num_tokens` of them, or (None)
        restarted from zero."""
        if num_tokens is None:
            self.resumes.labels(outcome="restarted").inc()
            return
        self.resumes.labels(outcome="resumed").inc()
        self.resumed_tokens.inc(num_tokens)

    def observe_adapter_loads(self, num_host_loads: int, num_slot_loads: int) -> None:
        """The engine's load counts so far (it keeps the totals): add what is new since the last call."""
        self.lora_adapter_loads.inc(max(0, num_host_loads - self._seen_adapter_loads[0]))
        self.lora_slot_loads.inc(max(0, num_slot_loads - self._seen_adapter_loads[1]))
        self._seen_adapter_loads = (num_host_loads, num_slot_loads)

    def observe_step(self) -> None:
        self.engine_steps.inc()

    # Clock skew between a producer and this worker can make an enqueue-based duration negative:
    # those are clamped to 0 rather than dropped, so that the count still matches the jobs.
    def observe_queue_wait(self, seconds: float) -> None:
        self.queue_wait.observe(max(0.0, seconds))

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(max(0.0, seconds))

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(max(0.0, seconds))

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.observe(max(0.0, seconds))


def installed_version() -> str:
    """qworker's version as installed (pyproject.toml's), read from the package metadata rather
    than the top-level package, which the worker does not import."""
    try:
        return version("qworker")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"

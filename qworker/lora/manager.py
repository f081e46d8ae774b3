"""The adapters of one engine: loaded off the step loop into a host-memory LRU, and placed in
the device's `max_loras` slots as the scheduler admits their requests.

- Loading. A request whose adapter is not in host memory waits here, outside the scheduler (no
  KV blocks, no place in the queue that others wait behind), while one background thread reads
  and checks the adapter's files (`peft_adapter.load_adapter`). Each step, `take_ready` hands
  back the waiting requests whose adapter is now loaded (they join the scheduler) and those
  whose adapter failed (they fail, each with the adapter's LoRAAdapterError; others go on);
  `start_loads` then starts the loads that host memory has room for.
- Host memory. At most `max_cpu_loras` adapters are loaded or loading. An adapter is pinned
  while requests in the scheduler use it; the least recently used unpinned one is evicted to
  make room, and a load waits while every loaded adapter is pinned.
- Slots. The scheduler counts slots as it counts blocks: a waiting request can start when its
  adapter holds a slot already or a slot is unused (`can_acquire`); starting takes a reference
  on the slot (`acquire`, which says when the slot must be filled: the plan carries the copy,
  which the runner makes before the step), and finishing or preemption drops it (`release`). An
  unused slot keeps its adapter until another needs the slot (least recently used first).
- Counts. `num_host_loads`: adapters read from their files into host memory (each one a miss of
  the LRU: a first use, or a use after eviction); failed loads are not counted. `num_slot_loads`:
  slots filled with an adapter's tensors (a copy from host memory, no file read). A pool's
  adapter affinity shows in the first: the files are the slow part.

Only the engine's thread calls this object; the loader thread only runs `load_adapter`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from qworker.errors import LoRAAdapterError
from qworker.lora.peft_adapter import LoRAAdapter, load_adapter
from qworker.lora.request import LoRARequest
from qworker.model.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class WaitingForAdapter:
    """A request waiting for its adapter to load; `start` queues it in the scheduler."""

    request_id: str
    lora_request: LoRARequest
    start: Callable[[], None]


@dataclass
class _Slot:
    lora_int_id: int | None = None
    num_refs: int = 0
    last_used: int = 0
    # The slot's tensors may not hold its adapter (a step that should have filled it failed).
    is_stale: bool = False


@dataclass
class _Load:
    request: LoRARequest
    future: Future[LoRAAdapter] | None = None
    waiting: list[WaitingForAdapter] = field(default_factory=list)


class LoRAManager:
    def __init__(
        self, model_config: ModelConfig, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int
    ) -> None:
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self._executor: ThreadPoolExecutor | None = None
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._pins: dict[int, int] = {}
        self._loads: dict[int, _Load] = {}  # loading, or queued for host room (future None)
        self._failed: list[tuple[WaitingForAdapter, LoRAAdapterError]] = []
        self._slots = [_Slot() for _ in range(max_loras)]
        self._slot_of: dict[int, int] = {}
        self._clock = 0
        self.num_host_loads = 0
        self.num_slot_loads = 0

    def loaded_names(self) -> list[str]:
        """The names of the adapters in host memory, least recently used first."""
        return [adapter.request.lora_name for adapter in self._host.values()]

    # -- waiting for adapters (engine) -------------------------------------------------------

    def is_loaded(self, lora_request: LoRARequest) -> bool:
        """The adapter is in host memory (as this request names it): the request can queue."""
        adapter = self._host.get(lora_request.lora_int_id)
        if adapter is None or adapter.request != lora_request:
            return False
        self._host.move_to_end(lora_request.lora_int_id)
        return True

    def wait_for_adapter(self, waiting: WaitingForAdapter) -> None:
        """Hold a request until its adapter is loaded (take_ready hands it back)."""
        lora = waiting.lora_request
        load = self._loads.get(lora.lora_int_id)
        try:
            if load is not None:
                self._check_same(load.request, lora)
            elif lora.lora_int_id in self._host:
                self._check_same(self._host[lora.lora_int_id].request, lora)
        except LoRAAdapterError as exc:
            self._failed.append((waiting, exc))
            return
        if load is None:
            load = self._loads[lora.lora_int_id] = _Load(lora)
        load.waiting.append(waiting)
        self._pump()

    def _check_same(self, known: LoRARequest, asked: LoRARequest) -> None:
        if known.lora_path != asked.lora_path or known.lora_name != asked.lora_name:
            raise LoRAAdapterError(
                f"lora_int_id {asked.lora_int_id} is adapter {known.lora_name!r} at {known.lora_path} in "
                f"this engine, not {asked.lora_name!r} at {asked.lora_path}: one id per adapter"
            )

    def abort(self, request_id: str) -> bool:
        """Drop a waiting request; False when it is not waiting here."""
        for load in self._loads.values():
            for waiting in load.waiting:
                if waiting.request_id == request_id:
                    load.waiting.remove(waiting)
                    return True
        for item in self._failed:
            if item[0].request_id == request_id:
                self._failed.remove(item)
                return True
        return False

    def __contains__(self, request_id: str) -> bool:
        return any(w.request_id == request_id for load in self._loads.values() for w in load.waiting) or any(
            w.request_id == request_id for w, _ in self._failed
        )

    @property
    def has_waiting(self) -> bool:
        return bool(self._failed) or any(load.waiting for load in self._loads.values())

    def take_ready(self) -> list[tuple[WaitingForAdapter, LoRAAdapterError | None]]:
        """The waiting requests whose adapter loaded (error None: start them) or failed."""
        ready: list[tuple[WaitingForAdapter, LoRAAdapterError | None]] = list(self._failed)
        self._failed.clear()
        for lora_int_id, load in list(self._loads.items()):
            if load.future is None or not load.future.done():
                continue
            del self._loads[lora_int_id]
            try:
                adapter = load.future.result()
            except LoRAAdapterError as exc:
                logger.info("%s", exc)
                ready.extend((w, exc) for w in load.waiting)
                continue
            except Exception as exc:  # an unreadable adapter fails its requests only
                error = LoRAAdapterError(
                    f"LoRA adapter {load.request.lora_name!r} (id {lora_int_id}): {type(exc).__name__}: {exc}"
                )
                logger.warning("%s", error)
                ready.extend((w, error) for w in load.waiting)
                continue
            self._host[lora_int_id] = adapter
            self.num_host_loads += 1
            logger.info(
                "LoRA adapter %r (id %d) loaded: rank %d, %.1f MiB",
                adapter.request.lora_name, lora_int_id, adapter.rank, adapter.num_bytes / 2**20,
            )  # fmt: skip
            ready.extend((w, None) for w in load.waiting)
        return ready

    def start_loads(self) -> None:
        """Start the loads that host memory has room for; call it after the requests that
        take_ready handed back have joined the scheduler (their adapters pinned)."""
        self._pump()

    def wait_idle(self, timeout_s: float = 0.05) -> None:
        """Block a little while adapters load and nothing else can run."""
        futures = [load.future for load in self._loads.values() if load.future is not None and load.waiting]
        if futures and not self._failed:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def _pump(self) -> None:
        """Start the loads that host memory has room for, evicting unpinned adapters."""
        for load in self._loads.values():
            if load.future is not None:
                continue
            if not load.waiting:
                continue
            num_held = len(self._host) + sum(1 for other in self._loads.values() if other.future is not None)
            if num_held >= self.max_cpu_loras and not self._evict_one():
                return
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qworker-lora")
            load.future = self._executor.submit(
                load_adapter, load.request, self.model_config, self.max_lora_rank
            )
        # Loads whose every waiter was aborted before they started.
        for lora_int_id in [i for i, load in self._loads.items() if load.future is None and not load.waiting]:
            del self._loads[lora_int_id]

    def _evict_one(self) -> bool:
        for lora_int_id in self._host:  # least recently used first
            if self._pins.get(lora_int_id, 0) == 0:
                del self._host[lora_int_id]
                return True
        return False

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- pins and slots (scheduler) ----------------------------------------------------------

    def pin(self, lora_int_id: int) -> None:
        """A request using the adapter joined the scheduler: keep it in host memory."""
        assert lora_int_id in self._host, f"adapter {lora_int_id} is not loaded"
        self._pins[lora_int_id] = self._pins.get(lora_int_id, 0) + 1

    def unpin(self, lora_int_id: int) -> None:
        count = self._pins[lora_int_id] - 1
        if count:
            self._pins[lora_int_id] = count
        else:
            del self._pins[lora_int_id]

    def can_acquire(self, lora_int_id: int) -> bool:
        return lora_int_id in self._slot_of or any(slot.num_refs == 0 for slot in self._slots)

    def acquire(self, lora_int_id: int) -> tuple[int, LoRAAdapter | None]:
        """A reference on the adapter's slot; the adapter when the slot must be filled first."""
        self._clock += 1
        index = self._slot_of.get(lora_int_id)
        if index is not None:
            slot = self._slots[index]
            slot.num_refs += 1
            slot.last_used = self._clock
            if slot.is_stale:
                slot.is_stale = False
                self.num_slot_loads += 1
                return index, self._host[lora_int_id]
            return index, None
        free = [i for i, slot in enumerate(self._slots) if slot.num_refs == 0]
        assert free, "acquire without can_acquire"
        # An empty slot first, else the one unused longest.
        index = min(free, key=lambda i: (self._slots[i].lora_int_id is not None, self._slots[i].last_used))
        slot = self._slots[index]
        if slot.lora_int_id is not None:
            del self._slot_of[slot.lora_int_id]
        slot.lora_int_id, slot.num_refs, slot.last_used, slot.is_stale = lora_int_id, 1, self._clock, False
        self._slot_of[lora_int_id] = index
        self.num_slot_loads += 1
        return index, self._host[lora_int_id]

    def release(self, lora_int_id: int) -> None:
        self._slots[self._slot_of[lora_int_id]].num_refs -= 1

    def mark_stale(self, slot_indices: list[int]) -> None:
        """The step that should have filled these slots failed: fill them again when next used."""
        for index in slot_indices:
            self._slots[index].is_stale = True

    @property
    def num_free_slots(self) -> int:
        return sum(1 for slot in self._slots if slot.num_refs == 0)

    def slot_of(self, lora_int_id: int) -> int | None:
        return self._slot_of.get(lora_int_id)

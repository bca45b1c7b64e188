"""The engine's LoRA adapters on their three tiers: registered (on disk), read (host
memory, at most `max_cpu_loras`), and in the fast pool the forward pass reads (at most
`max_loras` slots, servelab.model.lora_layers.LoRAState).

`register` reads and checks an adapter when a request first names it (errors are the
request's: RequestError naming the file and field), so a bad adapter fails its request
and nothing else. `slots_for` places a step's adapters in the pool before the forward,
evicting what the residency policy (`[adapter_residency]`, kind `adapter_residency`)
chooses among the resident adapters the step does not need; an adapter dropped from host
memory is read from disk again when next needed.

Requests may be checked on another thread than the step loop (the server's), so the
tables are changed under one lock; an adapter is read from disk outside it.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Any, Callable, Mapping, Sequence as Seq

from servelab.contracts.adapter_residency import ResidentAdapter
from servelab.errors import RequestError
from servelab.kit.residency import checked_residency_choice
from servelab.logging_setup import get_logger
from servelab.lora_request import LoRARequest
from servelab.model.lora_adapter import LoRAAdapter, LoRAAdapterError, load_adapter
from servelab.model.lora_layers import LoRAState
from servelab.model.model_config import ModelConfig

logger = get_logger(__name__)


class LoRAManager:
    def __init__(self, model_config: ModelConfig, state: LoRAState, residency: Any, max_cpu_loras: int,
                 max_lora_rank: int, loader: Callable[..., LoRAAdapter] = load_adapter) -> None:
        self.model_config = model_config
        self.state = state
        self.residency = residency
        self.max_loras = len(state.slots)
        self.max_cpu_loras = max(max_cpu_loras, self.max_loras)
        self.max_lora_rank = max_lora_rank
        self.loader = loader
        self.requests: dict[int, LoRARequest] = {}  # registered adapters, by id
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # read adapters, least recently used first
        self.slot_of: dict[int, int] = {}  # adapters in the fast pool -> their slot
        self.loaded: dict[int, int] = {}  # pool adapters -> tick they entered it
        self.last_used: dict[int, int] = {}
        self.uses: Counter[int] = Counter()
        self.tick = 0
        self.num_pool_loads = 0  # adapters put into the pool (first loads and swaps back)
        self.num_disk_reads = 0
        # (waiting sequences per adapter id, ids of every adapter with sequences in flight), read
        # once a step; set by the engine
        self.demand: Callable[[], tuple[Mapping[int, int], set[int]]] = lambda: ({}, set())
        self._waiting: Mapping[int, int] = {}
        self._in_flight: set[int] = set()  # as of the last step: kept in host memory
        self._lock = threading.RLock()

    # ------------------------------------------------------------ registration

    def register(self, request: LoRARequest) -> int:
        """The id of `request`'s adapter, read and checked the first time it is named;
        RequestError (changing nothing) for an adapter that cannot be served."""
        if not isinstance(request, LoRARequest):
            raise RequestError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        with self._lock:
            if self._known(request) and request.lora_int_id in self.host:
                return request.lora_int_id
        # read here, for the request's own error, also when known but dropped from host memory
        adapter = self._read_file(request)
        with self._lock:
            if self._known(request) and request.lora_int_id in self.host:  # meanwhile, by another thread
                return request.lora_int_id
            self.requests[request.lora_int_id] = request
            self._keep_in_host(request.lora_int_id, adapter)
        logger.info("lora.registered", name=request.lora_name, lora_id=request.lora_int_id, path=request.lora_path)
        return request.lora_int_id

    def _known(self, request: LoRARequest) -> bool:
        """Whether `request` is registered already; RequestError where its id names another
        adapter. (A name may come back under a new id: a server that unloads an adapter and
        loads one of the same name gives it a new id, so nothing cached serves it.)"""
        known = self.requests.get(request.lora_int_id)
        if known is not None:
            if known != request:
                raise RequestError(f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} "
                                   f"at {known.lora_path!r}; give each adapter its own id")
            return True
        return False

    def unregister(self, lora_id: int) -> None:
        """Forget an adapter (the caller makes sure no sequence in flight runs with it)."""
        with self._lock:
            self.requests.pop(lora_id, None)
            self.host.pop(lora_id, None)
            slot = self.slot_of.pop(lora_id, None)
            if slot is not None:
                self.state.set_slot(slot, None)
            self.loaded.pop(lora_id, None)

    def by_name(self, name: str) -> LoRARequest | None:
        with self._lock:
            return next((r for r in self.requests.values() if r.lora_name == name), None)

    def registered(self) -> list[LoRARequest]:
        with self._lock:
            return sorted(self.requests.values(), key=lambda r: r.lora_int_id)

    def resident(self) -> list[str]:
        """Names of the adapters in the fast pool (what an adapter-affinity router follows)."""
        with self._lock:
            return sorted(self.requests[lora_id].lora_name for lora_id in self.slot_of)

    def _read_file(self, request: LoRARequest) -> LoRAAdapter:
        try:
            adapter = self.loader(request.lora_name, request.lora_path, self.model_config, self.max_lora_rank)
        except LoRAAdapterError as exc:
            raise RequestError(f"LoRA adapter {request.lora_name!r}: {exc}") from None
        self.num_disk_reads += 1
        return adapter

    def _keep_in_host(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self.host[lora_id] = adapter
        self.host.move_to_end(lora_id)
        # host memory holds at most max_cpu_loras adapters, more only while the pool's, or
        # those of sequences in flight, need more (so a step never reads a file)
        for other in list(self.host):
            if len(self.host) <= self.max_cpu_loras:
                break
            if other not in self.slot_of and other not in self._in_flight and other != lora_id:
                del self.host[other]

    # ------------------------------------------------------------ steps

    def slots_for(self, lora_ids: Seq[int]) -> list[int]:
        """The pool slot of each row's adapter (-1: the base model), every adapter of the
        step placed in the pool first."""
        with self._lock:
            return self._slots_for(lora_ids)

    def _slots_for(self, lora_ids: Seq[int]) -> list[int]:
        self.tick += 1
        needed = list(dict.fromkeys(i for i in lora_ids if i))
        self._waiting, in_flight = self.demand()
        self._in_flight = set(in_flight) | set(needed)
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step runs {len(needed)} LoRA adapters, more than max_loras={self.max_loras}: the "
                               f"scheduler must cap adapters per batch (SchedulerContext.max_loras_per_batch)")
        missing = [i for i in needed if i not in self.slot_of]
        if missing:
            self._make_room(len(missing), set(needed))
            for lora_id in missing:
                self._load(lora_id)
        for lora_id in needed:
            self.last_used[lora_id] = self.tick
            self.uses[lora_id] += 1
        return [self.slot_of[i] if i else -1 for i in lora_ids]

    def _make_room(self, num_needed: int, needed: set[int]) -> None:
        free = self.max_loras - len(self.slot_of)
        if free >= num_needed:
            return
        demand = self._waiting
        candidates = [ResidentAdapter(lora_id=i, name=self.requests[i].lora_name, loaded=self.loaded[i],
                                      last_used=self.last_used.get(i, 0), uses=self.uses[i],
                                      num_waiting=demand.get(i, 0), rank=self.host[i].max_rank,
                                      nbytes=self.host[i].nbytes)
                      for i in sorted(self.slot_of) if i not in needed]
        for lora_id in checked_residency_choice(self.residency, candidates, num_needed - free):
            self.state.set_slot(self.slot_of.pop(lora_id), None)
            del self.loaded[lora_id]
            logger.debug("lora.evicted", lora_id=lora_id)

    def _load(self, lora_id: int) -> None:
        adapter = self.host.get(lora_id)
        if adapter is None:  # dropped from host memory before its request came in: read it again
            try:
                adapter = self._read_file(self.requests[lora_id])
            except RequestError as exc:
                raise RuntimeError(f"LoRA adapter {self.requests[lora_id].lora_name!r} changed on disk while "
                                   f"requests used it: {exc}") from None
        self._keep_in_host(lora_id, adapter)
        slot = self.state.slots.index(None)
        self.state.set_slot(slot, dict(adapter.modules))
        self.slot_of[lora_id] = slot
        self.loaded[lora_id] = self.tick
        self.num_pool_loads += 1

"""Rank 0's model runner under tensor parallelism.

The engine, its scheduler, allocator and drafter run once, on rank 0; this runner looks
to them like the single-process one. Each step it broadcasts the step's inputs (and the
copy-on-write block copies queued since the last step) to the other ranks, then runs its
own shard; the row-parallel layers' all-reduces keep the ranks in lockstep and the LM
head's columns are gathered on rank 0, which samples.

A rank that dies or stops answering turns the step into a DistributedError naming it;
every rank is then shut down and the runner refuses further steps.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Sequence as Seq

import torch
import torch.distributed as dist

from servelab.distributed.comm import Communicator
from servelab.distributed.launch import (WorkerSet, backend_for, cpu_threads_per_rank, init_group,
                                         launched_by_torchrun)
from servelab.distributed.shard_runner import ShardSpec, build_shard_runner, lm_head, pack_inputs, rank_device, serve
from servelab.errors import DistributedError
from servelab.interfaces import Runner
from servelab.logging_setup import get_logger
from servelab.runner import ModelInputs, ModelRunner

logger = get_logger(__name__)


def _let_gloo_release_its_work() -> None:
    """Under torchrun the stop message is a gloo broadcast. Gloo's worker thread drops its
    hold on the broadcast's tensors a moment after the broadcast returns, and doing so needs
    the GIL: if this process is finalizing by then, that thread is killed mid-destructor and
    the process aborts ("terminate called without an active exception", seen in about one
    run in eight). Sleeping releases the GIL and gives the thread that moment."""
    time.sleep(0.2)


class _Ranks:
    """What must be torn down however the runner ends (kept apart so a finalizer can hold it)."""

    def __init__(self, comm: Communicator | None, workers: WorkerSet | None, owns_group: bool) -> None:
        self.comm = comm
        self.workers = workers
        self.owns_group = owns_group
        self.in_sync = True  # False once a message was cut short: the others cannot be told to stop
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.comm is not None and self.in_sync:
            try:
                self.comm.send(("stop", None))
                if self.workers is None:
                    _let_gloo_release_its_work()
            except Exception:  # noqa: BLE001 - a dead rank: the workers are stopped below anyway
                pass
        if self.workers is not None:
            self.workers.stop(grace_s=5.0 if self.in_sync else 0.0)
        if self.owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a group broken by a dead rank
                pass


class TensorParallelRunner(Runner):
    """ModelRunner's interface (prepare, execute, execute_with_hidden, copy_blocks, lm_head,
    vocab_size, device, kv_caches) over N ranks."""

    supports_prompt_logprobs = False  # the prompt rows would need every rank's vocabulary columns

    def __init__(self, local: ModelRunner, comm: Communicator, ranks: _Ranks, vocab_size: int,
                 threads: int = 0, spec: ShardSpec | None = None) -> None:
        self.local = local
        self.spec = spec
        self.comm = comm
        self.device = local.device
        self.block_size = local.block_size
        self._vocab_size = vocab_size
        self._ranks = ranks
        self._pending_copies: list[tuple[int, int]] = []
        self._messages = 0
        self._failure: str | None = None
        # On the CPU each rank computes with its share of the cores; rank 0 switches to its
        # share only while it computes, so the rest of the process keeps its own setting.
        self._threads = threads
        self._finalizer = weakref.finalize(self, ranks.close)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def model(self) -> Any:
        return self.local.model

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rank 0's cache: its own heads only."""
        return self.local.kv_caches

    @property
    def tensor_parallel_size(self) -> int:
        return self.comm.size

    def prepare(self, plan: Any, allocator: Any, prompt_logprobs: bool = False) -> ModelInputs:
        if prompt_logprobs:
            raise ValueError("tensor parallelism does not score prompts (supports_prompt_logprobs is False)")
        return self.local.prepare(plan, allocator)

    def copy_blocks(self, copies: Seq[tuple[int, int]]) -> None:
        """Queued; every rank copies them (in order) before the next step's forward pass."""
        self._pending_copies.extend(copies)

    def execute(self, inputs: ModelInputs) -> torch.Tensor:
        return self.execute_with_hidden(inputs)[0]

    def execute_with_hidden(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
        copies, self._pending_copies = self._pending_copies, []

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            self.comm.send(("step", (copies, pack_inputs(inputs))))
            if copies:
                self.local.copy_blocks(copies)
            return self.local.execute_with_hidden(inputs)

        return self._collective(run, "a step")

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final-normed hidden states (every rank computes its vocabulary columns)."""
        def run() -> torch.Tensor:
            self.comm.send(("lm_head", hidden.detach().float().cpu().numpy()))
            return lm_head(self.local, hidden)

        return self._collective(run, "an LM head call")

    def _collective(self, run: Any, what: str) -> Any:
        if self._failure is not None:
            raise DistributedError(f"{self._failure}; the engine has stopped")
        workers = self._ranks.workers
        if workers is not None and workers.dead_ranks():
            self._fail(workers.diagnose(self._messages, f"before {what}", RuntimeError("dead")))
        self._ranks.in_sync = False
        threads_before = torch.get_num_threads()
        if self._threads and threads_before != self._threads:
            torch.set_num_threads(self._threads)
        try:
            result = run()
        except BaseException as exc:
            if not isinstance(exc, Exception):  # KeyboardInterrupt mid-step: the ranks are out of step
                self.close()
                raise
            message = (workers.diagnose(self._messages + 1, f"during {what}", exc) if workers is not None
                       else f"tensor-parallel collective failed during {what}: {type(exc).__name__}: {exc}")
            self._fail(message, exc)
        finally:
            if torch.get_num_threads() != threads_before:
                torch.set_num_threads(threads_before)
        self._ranks.in_sync = True
        self._messages += 1
        return result

    def _fail(self, message: str, cause: BaseException | None = None) -> None:
        self._failure = message
        logger.error("tensor_parallel.failed", error=message)
        self.close()
        raise DistributedError(f"{message}; every rank was shut down") from cause

    def close(self) -> None:
        """Stop every rank (idempotent; also runs when the runner is collected or at exit)."""
        self._finalizer()


def start_tensor_parallel(spec: ShardSpec, vocab_size: int, timeout_s: float,
                          backend: Any = None, runner_class: type = TensorParallelRunner) -> TensorParallelRunner:
    """Rank 0's runner, the other ranks started (or, under torchrun, joined). On a torchrun
    rank other than 0 this serves rank 0 and then exits the process. `backend` is rank 0's
    attention backend (the others build their own from the spec)."""
    engine = spec.engine
    if launched_by_torchrun(spec.size):
        return _join_torchrun(spec, vocab_size, timeout_s, backend, runner_class)
    device = rank_device(engine, 0)
    threads = cpu_threads_per_rank(spec.size) if device.type == "cpu" else 0
    workers = WorkerSet(spec, timeout_s, threads)
    ranks = _Ranks(None, workers, owns_group=True)
    try:
        workers.wait_for("hello", max(timeout_s, 60.0))
        if dist.is_initialized():
            raise DistributedError("this process already belongs to a torch.distributed process group; "
                                   "one tensor-parallel engine per process (close the other first)")
        comm = init_group(backend_for(device), 0, spec.size, workers.init_method, timeout_s, device,
                          workers.channel())
        ranks.comm = comm
        local = build_shard_runner(spec, 0, comm, backend)
        workers.wait_for("ready", max(timeout_s, 60.0))
    except BaseException:
        ranks.in_sync = False
        ranks.close()
        raise
    logger.info("tensor_parallel.started", size=spec.size, backend=backend_for(device),
                pids=[p.pid for p in workers.processes.values()], threads_per_rank=threads or None)
    return runner_class(local, comm, ranks, vocab_size, threads, spec=spec)


def _join_torchrun(spec: ShardSpec, vocab_size: int, timeout_s: float, backend: Any,
                   runner_class: type = TensorParallelRunner) -> TensorParallelRunner:
    import os

    rank = int(os.environ["RANK"])
    device = rank_device(spec.engine, int(os.environ.get("LOCAL_RANK", rank)))
    owns_group = not dist.is_initialized()
    comm = init_group(backend_for(device), rank, spec.size, None, timeout_s, device)
    local = build_shard_runner(spec, rank, comm, backend)
    if rank != 0:
        serve(local, comm, spec=spec)
        _let_gloo_release_its_work()  # the stop message was a gloo broadcast here too
        if owns_group:
            dist.destroy_process_group()
        raise SystemExit(0)
    return runner_class(local, comm, _Ranks(comm, None, owns_group), vocab_size, spec=spec)


class ExpertParallelRunner(TensorParallelRunner):
    """Rank 0's runner under expert parallelism (servelab.distributed.expert_parallel):
    the same lockstep over the ranks; rank 0 holds the whole vocabulary, so it scores
    prompts too; it reports the expert load it measured and re-places the experts by it
    every `[engine] expert_rebalance_steps` steps (0: never)."""

    supports_prompt_logprobs = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._steps = 0
        self.num_rebalances = 0

    @property
    def expert_parallel_size(self) -> int:
        return self.comm.size

    def prepare(self, plan: Any, allocator: Any, prompt_logprobs: bool = False) -> ModelInputs:
        return self.local.prepare(plan, allocator, prompt_logprobs)

    def expert_load(self) -> dict[int, list[int]]:
        return self.local.expert_load()

    def placements(self) -> dict[int, Any]:
        """Each sparse layer's current placement."""
        return {layer: block.dispatcher.placement for layer, block in self.local.model.sparse_blocks().items()}

    def execute_with_hidden(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
        result = super().execute_with_hidden(inputs)
        self._steps += 1
        interval = self.spec.engine.expert_rebalance_steps
        if interval and self._steps % interval == 0:
            self.rebalance()
        return result

    def rebalance(self) -> dict[int, Any]:
        """Re-place every sparse layer's experts by the load measured so far (every rank
        loads what it gains); returns the new placements."""
        from servelab.distributed.expert_parallel import rebalanced_placements
        from servelab.distributed.shard_runner import rebalance_shard
        from servelab.expert_placement import placement_policy

        policy = placement_policy(self.spec.expert_placement, self.spec.redundant_experts)
        placements = rebalanced_placements(self.expert_load(), policy, self.comm.size)

        def run() -> None:
            self.comm.send(("rebalance", placements))
            rebalance_shard(self.local, self.spec, self.comm, placements)

        self._collective(run, "an expert rebalance")
        self.num_rebalances += 1
        logger.info("expert_parallel.rebalanced", placement=self.spec.expert_placement,
                    imbalance={layer: round(p.imbalance([float(c) for c in self.expert_load()[layer]]), 3)
                               for layer, p in placements.items()})
        return placements


class PipelineParallelRunner(TensorParallelRunner):
    """Rank 0's runner under pipeline parallelism (servelab.distributed.pipeline_parallel):
    the same lockstep messages; rank 0 holds the whole vocabulary, so it scores prompts
    too, and measures its stage's bubble (`pipeline_stats`)."""

    supports_prompt_logprobs = True

    @property
    def pipeline_parallel_size(self) -> int:
        return self.comm.size // self.spec.tensor_parallel_size

    @property
    def tensor_parallel_size(self) -> int:
        """TP ranks within each stage."""
        return self.spec.tensor_parallel_size

    def prepare(self, plan: Any, allocator: Any, prompt_logprobs: bool = False) -> ModelInputs:
        return self.local.prepare(plan, allocator, prompt_logprobs)

    def pipeline_stats(self) -> Any:
        """Rank 0's compute and wait time over the steps so far (PipelineStats), with every
        stage's in `stage_times` (the other ranks publish theirs after each message)."""
        stats = self.local.model.pipeline[2]
        workers = self._ranks.workers
        if workers is not None and workers.progress.stage_times is not None:
            times = workers.progress.stage_times
            tp = self.spec.tensor_parallel_size
            stats.stage_times = ((stats.compute_s, stats.wait_s),
                                 *((float(times[stage * tp][0]), float(times[stage * tp][1]))
                                   for stage in range(1, self.pipeline_parallel_size)))
        return stats

    @property
    def max_batches_in_flight(self) -> int:
        """How many batches the engine may have down the pipeline at once (`[engine]
        pipeline_batches_in_flight`; 0 there: one per stage)."""
        return self.spec.engine.pipeline_batches_in_flight or self.pipeline_parallel_size

    def execute_with_hidden(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """A step cut into micro-batches in flight down the pipeline where its rows allow."""
        from servelab.distributed.pipeline_parallel import splittable

        if not splittable(inputs):
            return super().execute_with_hidden(inputs)
        return self.complete(self._start(inputs))

    def submit(self, inputs: ModelInputs) -> Any:
        """Send a batch down the pipeline: rank 0 computes its stage and returns at once; the
        batch's logits come from `complete`, in submission order. Up to
        `max_batches_in_flight` batches may be submitted before the oldest is completed."""
        return self._start(inputs)

    def complete(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and hidden rows of the oldest batch submitted and not yet completed."""
        from servelab.distributed.pipeline_parallel import finish_pipelined

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            self.comm.send(("finish_micro", None))
            return finish_pipelined(self.local, batch)

        return self._collective(run, "a step's last stage")

    def _start(self, inputs: ModelInputs) -> Any:
        """A batch's rows cut into micro-batches (where they can be), sent down the pipeline
        with rank 0's stage computed."""
        from servelab.distributed.pipeline_parallel import piece_sizes, split_inputs, splittable, start_pipelined

        parts = [inputs]
        if splittable(inputs):
            engine = self.spec.engine
            pieces = engine.pipeline_micro_batches or self.pipeline_parallel_size
            parts = split_inputs(inputs, piece_sizes(inputs, pieces, engine.pipeline_chunk_sizing,
                                                     self.local.model.config))
        copies, self._pending_copies = self._pending_copies, []

        def run() -> Any:
            self.comm.send(("step_micro", (copies, [pack_inputs(part) for part in parts])))
            if copies:
                self.local.copy_blocks(copies)
            return start_pipelined(self.local, parts)

        return self._collective(run, "a step")

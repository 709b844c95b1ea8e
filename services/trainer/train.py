"""The training loop: a job's committed shards -> a drafter checkpoint in storage, over any number of processes.

`train` is the whole run: find the checkpoint to resume from (if any), build every part fresh from the config
(`build_trainer`), restore the checkpoint into them (`Trainer.restore`), then `Trainer.run_training`. The parts
live in their own modules: config.py (the knobs and the CLI), step.py (objective, optimizer, schedule, one step),
data.py (which samples, in which order), checkpoint.py (the saved record), distributed.py (ranks), curves.py and
metrics.py (what a run shows while it runs).

Every rank plans the same groups (data.BatchPlanner, from manifest metadata; rank 0 alone follows the job and
broadcasts what it learns), so ranks never disagree on when the data, an epoch or the run ends.
"""

import logging
import math
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prometheus_client import start_http_server
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from services.trainer import evaluate, metrics
from services.trainer.checkpoint import (
    Checkpoint,
    RankState,
    capture_rng_state,
    find_resume_checkpoint,
    frozen_parameter_names,
    parameters_sha256,
    restore_drafter,
    restore_rng_state,
    save_checkpoint,
    trainable_state,
)
from services.trainer.config import TrainConfig, compiles_backbone, resumed_config
from services.trainer.curves import curves_html
from services.trainer.data import (
    NOT_READY,
    BatchPlanner,
    BroadcastShardSource,
    DataPosition,
    DataStats,
    DecodedSampleCache,
    PlannedBatch,
    SampleCache,
    SampleLoader,
    ShardFollower,
    ShardSource,
    TargetSignature,
    plan_all,
    usable_memory_bytes,
)
from services.trainer.distributed import Runtime, init_runtime
from services.trainer.drafter import Eagle3Drafter, TargetHead, build_drafter, read_target_config
from services.trainer.loss import Batch
from services.trainer.step import (
    StepOutOfMemory,
    StepResult,
    TrainClock,
    TTTObjective,
    autocast,
    build_optimizer,
    build_scheduler,
    place_models,
    train_step,
)
from shared.data.vocab import load_vocab_mapping
from shared.errors import ConfigurationError
from shared.lifecycle import progress
from shared.lifecycle.jobs import load_job
from shared.lifecycle.kinds import AUDIT
from shared.lifecycle.schemas import JobRecord, utc_now
from shared.provenance import check_same, sha256_bytes, target_identity
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import FileStorage, Storage, open_storage

logger = logging.getLogger(__name__)


@dataclass
class LoadingGroup:
    """A planned group of micro-batches whose samples (this rank's share) load in the background."""

    size: int  # micro-batches in the group, over all ranks
    position: DataPosition  # the planner's position after the group: what a checkpoint records once it trained
    batches: Future[list[Batch | None]]
    stats: DataStats  # what loading it counted, added to the loader's once the group is trained


# Real tokens per padded token after length-sorted packing; only used to guess the LR schedule's length when
# neither max_steps nor schedule_steps is given.
PACKING_EFFICIENCY = 0.85
# What a run gives up, in this order, when a micro-batch does not fit in GPU memory (TrainConfig's flags of the same
# names: each keeps less for backward for more compute).
RECOMPUTE_FLAGS = ("recompute_mlp",)


def train(
    config: TrainConfig, *, settings: Settings, resume: bool = False, resume_from: str | None = None
) -> dict[str, Any]:
    """Train a drafter on a job's committed shards; returns a summary (on every rank; rank 0's has the held-out
    metrics). Under torchrun, joins the process group itself."""
    runtime = init_runtime(config.device)
    storage = open_storage(settings.storage_url, settings)
    check_audit(storage, config.job_id, required=config.require_audit)
    checkpoint = find_resume_checkpoint(storage, config, resume=resume, resume_from=resume_from)
    if checkpoint is not None:
        config = resumed_config(checkpoint.train_config, config)
    trainer = build_trainer(config, settings=settings, runtime=runtime, storage=storage, resuming=checkpoint)
    if checkpoint is not None:
        trainer.restore(checkpoint)
    summary = trainer.run_training()
    runtime.close()  # only after a run that ended on every rank (Runtime.close says why)
    return summary


def check_audit(storage: Storage, job_id: str, *, required: bool) -> None:
    """A job whose last audit failed trains only with a warning, and not at all when an audit is required."""
    report = AUDIT.last_report(storage, job_id)
    if report is None:
        if required:
            raise ConfigurationError(f"job {job_id} was never audited (--require-audit): `eagle3 audit {job_id}`")
        return
    if not report.passed:
        message = (
            f"job {job_id}: its last audit ({report.audit_job_id}) failed on {report.samples_failed} of "
            f"{report.samples_checked} samples, e.g. {report.failures[0].sample_id}: {report.failures[0].reasons[0]}"
            if report.failures
            else f"job {job_id}: its last audit ({report.audit_job_id}) checked no sample"
        )
        if required:
            raise ConfigurationError(message + " (--require-audit)")
        logger.warning("%s; training anyway", message)


def estimate_schedule_steps(job: JobRecord, config: TrainConfig, world_size: int) -> int:
    """The LR schedule's length when not given: the job's planned training tokens over tokens per step."""
    train_tokens = job.tokens_total * (1.0 - config.heldout_fraction) * config.epochs
    per_step = config.batch_tokens * config.grad_accum * world_size * PACKING_EFFICIENCY
    return max(1, math.ceil(train_tokens / per_step))


def check_target_and_vocab(job: JobRecord, model_path: Path, mapping_bytes: bytes) -> None:
    """Refuse a target or vocab mapping other than the ones the job's hidden states were captured with."""
    assert job.provenance is not None
    recorded = job.provenance.model_dump()
    found = {**target_identity(model_path), "vocab_mapping_sha256": sha256_bytes(mapping_bytes)}
    check_same(found, recorded, what=f"training job {job.job_id} with the target at {model_path}")


def build_trainer(
    config: TrainConfig, *, settings: Settings, runtime: Runtime, storage: Storage, resuming: Checkpoint | None
) -> "Trainer":
    """Every part of a run, built fresh. A checkpoint being resumed fixes only what the parts' shapes depend on:
    the aux layers the drafter reads and the schedule's length; its state is restored afterwards."""
    job = load_job(storage, config.job_id)
    model_path = Path(config.model_path or job.model.path)
    if resuming is not None:
        aux_layer_ids = resuming.drafter_config.aux_layer_ids
    else:
        aux_layer_ids = config.aux_layer_ids or job.aux_layer_ids
    expected = TargetSignature.from_model_config(read_target_config(model_path), aux_layer_ids)
    mapping_key = layout.vocab_mapping(config.job_id)
    mapping_bytes = storage.get(mapping_key)
    if job.provenance is not None:
        check_target_and_vocab(job, model_path, mapping_bytes)

    # Rank 0 alone reads the job's shard events; its answers are broadcast (a refusal included).
    follower = runtime.on_rank0_or_raise(
        lambda: ShardFollower(
            job,
            storage=storage,
            expected=expected,
            redis_client=progress.connect(settings.redis_url, outage_wait_s=settings.redis_outage_wait_s)
            if config.follow
            else None,
            follow=config.follow,
            heldout_fraction=config.heldout_fraction,
            block_s=config.follow_block_s,
        )
    )
    # The ignore: follower is None on ranks other than 0, and there are other ranks only when distributed.
    source: ShardSource = BroadcastShardSource(follower, runtime.control_group) if runtime.distributed else follower  # type: ignore[assignment]

    # The model. Seeded identically on every rank; DDP also broadcasts rank 0's weights.
    torch.manual_seed(config.seed)
    mapping = load_vocab_mapping(mapping_bytes, source=mapping_key)
    drafter, target_head = build_drafter(
        model_path, mapping, aux_layer_ids=aux_layer_ids, init_from_target=config.init_from_target
    )
    drafter.config.recompute_mlp = config.recompute_mlp
    place_models(drafter, target_head, runtime.device)
    if compiles_backbone(config, runtime.device.type):
        drafter.compile_backbone()
    objective: nn.Module = TTTObjective(
        drafter, target_head, ttt_length=config.ttt_length, step_decay=config.step_decay
    )
    if runtime.distributed:
        # The frozen parameters never change and the embedding is on the host, away from the rest: DDP leaves them be.
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            objective, sorted(frozen_parameter_names(objective))
        )
        # Buffers (d2t, t2d) never change, so there is nothing to broadcast before each forward.
        objective = DistributedDataParallel(
            objective,
            device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None,
            forward_sync_buffers=False,
        )
    if resuming is not None:
        schedule_steps = resuming.schedule_steps
    else:
        schedule_steps = (
            config.schedule_steps or config.max_steps or estimate_schedule_steps(job, config, runtime.world_size)
        )
    optimizer = build_optimizer(drafter, config)
    clock = TrainClock()

    # The data.
    planner = batch_planner(config, source)
    cache_root = Path(config.cache_dir) if config.cache_dir else settings.home / "trainer-cache"
    # A copy of local storage's files on local disk would only make each first read a write too.
    cache = (
        SampleCache(cache_root / config.job_id / f"rank{runtime.rank}", config.cache_budget_bytes)
        if config.cache_budget_bytes > 0 and not isinstance(storage, FileStorage)
        else None
    )
    memory_cache_bytes = config.memory_cache_bytes
    if memory_cache_bytes is None:
        memory_cache_bytes = usable_memory_bytes() // 4
    decoded = DecodedSampleCache(memory_cache_bytes) if memory_cache_bytes > 0 else None
    loader = SampleLoader(
        storage,
        job_id=config.job_id,
        hidden_size=expected.hidden_size,
        cache=cache,
        decoded=decoded,
        io_threads=config.io_threads,
        read_processes=config.read_processes,
        token_embedding=drafter.embed_tokens.weight.detach(),  # on the host (place_models)
        pin_memory=runtime.device.type == "cuda",
    )
    return Trainer(
        config,
        job=job,
        runtime=runtime,
        storage=storage,
        model_path=model_path,
        drafter=drafter,
        target_head=target_head,
        model=objective,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, config, schedule_steps, clock),
        clock=clock,
        schedule_steps=schedule_steps,
        planner=planner,
        loader=loader,
        follower=follower,
    )


def batch_planner(config: TrainConfig, source: ShardSource) -> BatchPlanner:
    """The batches a run's config asks for, over `source`'s shards, from the start of the data."""
    return BatchPlanner(
        source,
        batch_tokens=config.batch_tokens,
        max_length=config.max_length,
        epochs=config.epochs,
        position=DataPosition(seed=config.seed),
        pool_tokens=config.pool_tokens,
        sort_by_length=config.sort_by_length,
    )


class Trainer:
    """One training run of one job, from finished parts (see `build_trainer`)."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        job: JobRecord,
        runtime: Runtime,
        storage: Storage,
        model_path: Path,
        drafter: Eagle3Drafter,
        target_head: TargetHead,
        model: nn.Module,  # the TTT objective around the drafter, DDP-wrapped under torchrun
        optimizer: torch.optim.Optimizer,
        scheduler: LambdaLR,
        clock: TrainClock,  # the scheduler reads it: a run bounded by time decays with its time
        schedule_steps: int,
        planner: BatchPlanner,
        loader: SampleLoader,
        follower: ShardFollower | None,  # rank 0 only
    ) -> None:
        self.config, self.job, self.runtime, self.storage, self.model_path = config, job, runtime, storage, model_path
        self.drafter, self.target_head, self.model = drafter, target_head, model
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer, self.scheduler, self.schedule_steps = optimizer, scheduler, schedule_steps
        self.planner, self.loader, self.follower = planner, loader, follower
        self.position = planner.position.model_copy(deep=True)  # as of the last trained group
        self._forming: list[PlannedBatch] = []  # a group planned in part, waiting for the job's next shards
        # Groups load (read, verify, decode, collate) while the step before them runs on the device, up to
        # `prefetch_groups` of them at once.
        self._prefetch = ThreadPoolExecutor(max_workers=config.prefetch_groups, thread_name_prefix="load-ahead")
        self.step, self.train_tokens, self.clock = 0, 0, clock
        self.history: list[dict[str, Any]] = []
        self.recomputed: list[dict[str, Any]] = []  # flags switched on after a micro-batch ran out of GPU memory
        self.data_wait_s = 0.0  # the log window's time spent waiting for loads: the device idled that long
        self.last_saved_step = -1
        self.labels = (config.job_id, config.run_name)

    def restore(self, checkpoint: Checkpoint) -> None:
        """Continue exactly where `checkpoint` stopped: weights, optimizer, schedule, data position, RNG."""
        if checkpoint.provenance is not None and self.job.provenance is not None:
            check_same(
                self.job.provenance,
                checkpoint.provenance,
                what=f"resuming {checkpoint.source} on job {self.job.job_id}",
            )
        restore_drafter(self.drafter, checkpoint, built_from=f"{self.model_path} and job {self.config.job_id}")
        self.optimizer.load_state_dict(checkpoint.optimizer)
        self.scheduler.load_state_dict(checkpoint.scheduler)
        self.planner.position = checkpoint.data_position.model_copy(deep=True)
        self.position = checkpoint.data_position.model_copy(deep=True)
        self.step, self.last_saved_step = checkpoint.step, checkpoint.step
        self.train_tokens, self.clock.seconds = checkpoint.train_tokens, checkpoint.train_seconds
        self.history = list(checkpoint.history)
        ranks, rank = checkpoint.ranks, self.runtime.rank
        if len(ranks) != self.runtime.world_size:
            logger.warning(
                "checkpoint from %d processes resumed on %d: RNG streams start afresh",
                len(ranks),
                self.runtime.world_size,
            )
        if rank < len(ranks):
            restore_rng_state(ranks[rank].rng)
            self.loader.stats = ranks[rank].data_stats

    # -- the loop

    def run_training(self) -> dict[str, Any]:
        config, runtime = self.config, self.runtime
        if runtime.rank == 0 and config.metrics_port:
            start_http_server(config.metrics_port)
            logger.info("Prometheus metrics on port %d", config.metrics_port)
        metrics.STEP.labels(*self.labels).set(self.step)
        started = time.monotonic()

        def out_of_time() -> bool:
            return config.max_seconds is not None and time.monotonic() - started >= config.max_seconds

        stop_reason = "end_of_data"
        window: list[StepResult] = []
        window_started = time.monotonic()
        upcoming: deque[LoadingGroup] = deque()  # loading, in training order
        try:
            while True:
                if config.max_steps is not None and self.step >= config.max_steps:
                    stop_reason = "max_steps"
                    break
                if runtime.agree(out_of_time()):
                    stop_reason = "max_seconds"
                    break
                step_started = time.monotonic()
                if not upcoming:
                    group, timed_out = self._next_group(out_of_time, block=True)
                    if timed_out:
                        stop_reason = "max_seconds"
                        break
                    if not group:
                        break
                    upcoming.append(self._start_loading(group))
                current = upcoming.popleft()
                # The next groups' samples load while this one trains, as many as the planner has without waiting
                # for the job to commit more shards, up to prefetch_groups.
                while len(upcoming) < self.config.prefetch_groups:
                    ahead, _ = self._next_group(out_of_time, block=False)
                    if not ahead:
                        break
                    upcoming.append(self._start_loading(ahead))
                result = self._train_group(current)
                self.position = current.position
                self.clock.seconds += time.monotonic() - step_started
                if not result.stepped:
                    continue
                self.step += 1
                self.train_tokens += result.tokens
                window.append(result)
                self._publish(result)
                if self.step % config.log_every == 0:
                    self._log_window(window, time.monotonic() - window_started)
                    window, window_started = [], time.monotonic()
                if self.step % config.checkpoint_every == 0:
                    self._save_checkpoint()
        finally:
            for loading in upcoming:  # loaded ahead but never trained: the checkpoint's position is before them
                loading.batches.cancel()
            wait([loading.batches for loading in upcoming])
        if window:
            self._log_window(window, time.monotonic() - window_started)
        checkpoint = self._save_checkpoint() if self.step != self.last_saved_step else self._last_key()
        return self._finish(stop_reason, checkpoint)

    def _next_group(self, out_of_time: Any, *, block: bool) -> tuple[list[PlannedBatch], bool]:
        """The next group of planned micro-batches (shorter at the end of the data) and whether time ran out
        while waiting for shards. Without `block`, [] while the job has not committed what the group needs yet
        (the batches planned so far wait for the next call)."""
        size = self.config.grad_accum * self.runtime.world_size
        while len(self._forming) < size:
            planned = self.planner.next_batch(block=block)
            if planned is None:
                break
            if planned == NOT_READY:
                if not block:
                    return [], False
                if self.runtime.agree(out_of_time()):
                    return [], True
                continue
            self._forming.append(planned)
        group, self._forming = self._forming, []
        return group, False

    def _start_loading(self, group: list[PlannedBatch]) -> LoadingGroup:
        """This rank's share of `group`, loading in the background, with the planner's position after it."""
        mine = group[self.runtime.rank :: self.runtime.world_size]
        stats = DataStats()
        batches = self._prefetch.submit(lambda: [self.loader.load(planned, stats) for planned in mine])
        return LoadingGroup(len(group), self.planner.position.model_copy(deep=True), batches, stats)

    def _train_group(self, group: LoadingGroup) -> StepResult:
        A = self.config.grad_accum
        waited = time.monotonic()
        batches: list[Batch | None] = list(group.batches.result())
        self.data_wait_s += time.monotonic() - waited
        self.loader.stats.add(group.stats)
        batches += [None] * (A - len(batches))  # placeholders: the last group may be short
        while True:
            try:
                return train_step(
                    self.model,
                    batches,
                    optimizer=self.optimizer,
                    scheduler=self.scheduler,
                    params=self.params,
                    loss_scale=self.runtime.world_size / group.size,
                    max_grad_norm=self.config.max_grad_norm,
                    ttt_length=self.config.ttt_length,
                    device=self.runtime.device,
                    control_group=self.runtime.control_group,
                )
            except StepOutOfMemory as error:
                self._keep_less_for_backward(error, batches)

    def _keep_less_for_backward(self, error: StepOutOfMemory, batches: list[Batch | None]) -> None:
        """After a micro-batch ran out of GPU memory: from now on recompute each unrolled step's MLP in backward
        (what --recompute-mlp does: 32,768 tokens in 37.4 GiB at Llama-3.1-8B dims, for 0.94x the speed compiled),
        and the same micro-batches train again. A run of several ranks cannot retry one rank's step alone, and one
        that keeps as little as it can has nothing left to give up: those stop, saying what to change."""
        drafter_config = self.drafter.config

        def option(flag: str) -> str:
            return "--" + flag.replace("_", "-")

        flag = next((f for f in RECOMPUTE_FLAGS if not getattr(drafter_config, f)), None)
        tokens = max((b.input_ids.numel() for b in batches if b is not None), default=0)
        if flag is None or self.runtime.world_size > 1:
            given = " ".join(option(f) for f in RECOMPUTE_FLAGS if getattr(drafter_config, f))
            advice = "a smaller --batch-tokens" if flag is None else f"{option(flag)} on every rank"
            raise ConfigurationError(
                f"out of GPU memory at {tokens} tokens a micro-batch{f' with {given}' if given else ''}: "
                f"train with {advice} ({error})"
            ) from error
        setattr(drafter_config, flag, True)
        self.recomputed.append({"step": self.step, "tokens": tokens, "flag": flag})
        torch.cuda.empty_cache()
        logger.warning(
            "out of GPU memory at %d tokens a micro-batch (%s): %s from now on, and the step again",
            tokens,
            error,
            option(flag),
        )

    def _finish(self, stop_reason: str, checkpoint: str | None) -> dict[str, Any]:
        """Check that ranks agree, score the held-out shards (rank 0), and summarise the run."""
        config, runtime = self.config, self.runtime
        fingerprints = runtime.gather(parameters_sha256(self.drafter))
        if len(set(fingerprints)) != 1:
            logger.error("DDP ranks diverged: trainable weights differ (%s)", fingerprints)
        heldout = self._evaluate_heldout() if runtime.rank == 0 else {}
        stats = runtime.gather(self.loader.stats.as_dict())
        self._prefetch.shutdown()
        self.loader.close()
        if self.follower is not None and self.follower.mark is not None:
            self.follower.mark.stop()  # the job's data is read for good: it may be deleted from now on
        last = self.history[-1] if self.history else {}
        if runtime.rank == 0:
            logger.info(
                "run %s of job %s done (%s): %d steps, %d tokens in %.1fs, checkpoint %s",
                config.run_name,
                config.job_id,
                stop_reason,
                self.step,
                self.train_tokens,
                self.clock.seconds,
                checkpoint,
            )
        return {
            "job_id": config.job_id,
            "run_name": config.run_name,
            "steps": self.step,
            "stop_reason": stop_reason,
            "train_tokens": self.train_tokens,
            "train_seconds": round(self.clock.seconds, 3),
            "tokens_per_second": self.train_tokens / self.clock.seconds if self.clock.seconds else 0.0,
            "world_size": runtime.world_size,
            "final_loss": last.get("loss"),
            "final_step_accuracies": last.get("step_accuracies"),
            "checkpoint_key": checkpoint,
            "curves_key": layout.trainer_curves(config.job_id, config.run_name),
            "data_position": self.position.model_dump(exclude={"epoch_shards"}),
            "skipped_samples": sum(s["skipped_samples"] for s in stats),
            "skipped_by_reason": dict(sum((Counter(s["skipped_by_reason"]) for s in stats), Counter())),
            "memory_cache": self._memory_cache_stats(),
            "recomputation_after_out_of_memory": self.recomputed,
            "rank_parameter_sha256": fingerprints,
            "heldout": heldout,
            "history": self.history,
        }

    def _memory_cache_stats(self) -> dict[str, int] | None:
        """This rank's decoded-sample cache: samples served from memory, samples read, bytes held."""
        cache = self.loader.decoded
        return None if cache is None else {"hits": cache.hits, "misses": cache.misses, "bytes": cache.used_bytes}

    # -- what a run shows and keeps

    def _publish(self, result: StepResult) -> None:
        metrics.STEP.labels(*self.labels).set(self.step)
        metrics.TOKENS.labels(*self.labels).inc(result.tokens)
        metrics.LOSS.labels(*self.labels).set(result.loss)
        # A scheduler's rate may be a Tensor (a tensor lr); Gauge.set takes float() of it all the same.
        metrics.LEARNING_RATE.labels(*self.labels).set(float(self.scheduler.get_last_lr()[0]))
        for i, (step_loss, accuracy) in enumerate(zip(result.step_losses, result.step_accuracies, strict=True)):
            metrics.POSITION_LOSS.labels(*self.labels, str(i)).set(step_loss)
            metrics.POSITION_ACCURACY.labels(*self.labels, str(i)).set(accuracy)

    def _log_window(self, window: list[StepResult], seconds: float) -> None:
        """One history point (and one log line) per log window: means over its steps."""
        n = len(window)
        entry: dict[str, Any] = {
            "step": self.step,
            "loss": sum(r.loss for r in window) / n,
            "step_losses": [sum(v) / n for v in zip(*(r.step_losses for r in window), strict=True)],
            "step_accuracies": [sum(v) / n for v in zip(*(r.step_accuracies for r in window), strict=True)],
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": sum(r.grad_norm for r in window) / n,
            "train_tokens": self.train_tokens,
            "tokens_per_second": sum(r.tokens for r in window) / max(seconds, 1e-9),
            "data_wait_seconds": round(self.data_wait_s, 3),
        }
        waited = f" waited for data {self.data_wait_s / max(seconds, 1e-9):.0%}"
        self.data_wait_s = 0.0
        device = self.runtime.device
        memory = ""
        if device.type == "cuda":  # what long sequences run out of: the window's peak, then counted afresh
            entry["peak_device_memory_bytes"] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            metrics.PEAK_DEVICE_MEMORY.labels(*self.labels).set(entry["peak_device_memory_bytes"])
            memory = f" peak {entry['peak_device_memory_bytes'] / 2**30:.1f} GiB"
        self.history.append(entry)
        metrics.TOKENS_PER_SECOND.labels(*self.labels).set(entry["tokens_per_second"])
        if self.runtime.rank == 0:
            logger.info(
                "step %d loss %.4f acc %s lr %.2e grad_norm %.3f %.0f tokens/s%s%s",
                self.step,
                entry["loss"],
                " ".join(f"{a:.3f}" for a in entry["step_accuracies"]),
                entry["lr"],
                entry["grad_norm"],
                entry["tokens_per_second"],
                waited,
                memory,
            )

    def _last_key(self) -> str | None:
        if self.last_saved_step < 0:
            return None
        return layout.trainer_checkpoint(self.config.job_id, self.config.run_name, self.step)

    def _save_checkpoint(self) -> str:
        config = self.config
        stats = DataStats.from_dict(self.loader.stats.as_dict())  # a copy: the loader goes on counting
        ranks = self.runtime.gather(RankState(rng=capture_rng_state(), data_stats=stats))
        self.last_saved_step = self.step
        if self.runtime.rank != 0:
            return layout.trainer_checkpoint(config.job_id, config.run_name, self.step)
        checkpoint = Checkpoint(
            job_id=config.job_id,
            run_name=config.run_name,
            step=self.step,
            saved_at=utc_now(),
            model_path=str(self.model_path),
            drafter_config=self.drafter.config,
            train_config=config,
            drafter=trainable_state(self.drafter),
            optimizer=self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict(),
            schedule_steps=self.schedule_steps,
            data_position=self.position,
            ranks=ranks,
            train_tokens=self.train_tokens,
            train_seconds=self.clock.seconds,
            history=self.history,
            provenance=self.job.provenance.model_dump() if self.job.provenance is not None else None,
        )
        key = save_checkpoint(self.storage, checkpoint, keep=config.keep_checkpoints)
        title = f"{config.job_id} / {config.run_name}"
        self.storage.put(
            layout.trainer_curves(config.job_id, config.run_name), curves_html(self.history, title).encode()
        )
        return key

    def _evaluate_heldout(self) -> dict[str, Any]:
        assert self.follower is not None
        manifests = self.follower.heldout_manifests()
        if not manifests or not self.config.heldout_max_batches:
            logger.warning("job %s: no committed held-out shard to evaluate on", self.config.job_id)
            return {}
        planned = plan_all(manifests, batch_tokens=self.config.batch_tokens, max_length=self.config.max_length)
        batches = evaluate.heldout_batches(self.loader, planned[: self.config.heldout_max_batches], self.runtime.device)
        with autocast(self.runtime.device):
            result = evaluate.evaluate_heldout(self.drafter, self.target_head, batches, self.config.ttt_length)
        if "simulated_acceptance_length" in result:
            metrics.HELDOUT_ACCEPTANCE.labels(*self.labels).set(result["simulated_acceptance_length"])
        logger.info("held-out evaluation of job %s: %s", self.config.job_id, result)
        return result

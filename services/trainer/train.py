"""The training loop: AdamW with warmup + cosine, gradient clipping and accumulation, DDP over any number of
processes, checkpoints in storage that a resumed run continues exactly, training curves and Prometheus metrics.

Notable:
- One optimizer step trains one *group* of `grad_accum * world_size` planned micro-batches. Rank r takes
  micro-batches r, r + W, ... of the group, and each loss is scaled by W / len(group), so W processes compute the
  same update as one process with grad_accum * W (DDP averages gradients over ranks).
- Every rank plans the same groups (data.BatchPlanner, from manifest metadata; rank 0 alone follows the job and
  broadcasts what it learns), so ranks never disagree on when the data, an epoch or the run ends. A rank with
  fewer micro-batches than the others in the last group (or whose samples were all skipped) runs a zero-loss
  placeholder, so every rank joins every gradient all-reduce.
- bf16 autocast with fp32 master weights on CUDA; plain fp32 on CPU.
- A checkpoint holds only tensors and plain Python values (drafter weights without the frozen embedding, the
  DrafterConfig, the TrainConfig, optimizer, scheduler, data position, per-rank RNG and data stats, step, job id,
  loss history), so it loads with torch.load(weights_only=True): checkpoints live in shared storage and must never
  run code when read.
"""

import contextlib
import hashlib
import io
import json
import logging
import math
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from html import escape
from pathlib import Path
from typing import Any, Literal

import redis
import torch
import torch.distributed as dist
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge, start_http_server
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from services.trainer import evaluate, export
from services.trainer.data import (
    NOT_READY,
    BatchPlanner,
    BroadcastShardSource,
    DataPosition,
    DataStats,
    PlannedBatch,
    SampleCache,
    SampleLoader,
    ShardFollower,
    ShardSource,
    TargetSignature,
    plan_all,
)
from services.trainer.drafter import DrafterConfig, Eagle3Drafter, TargetHead, build_drafter, read_target_config
from services.trainer.loss import Batch, TTTOutput, ttt_loss
from shared import layout
from shared.errors import ConfigurationError, Eagle3Error
from shared.jobs import load_job
from shared.schemas import JobRecord, utc_now
from shared.settings import Settings
from shared.storage import ObjectNotFound, Storage, open_storage
from shared.vocab import VocabMapping, load_vocab_mapping

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
# Real tokens per padded token after length-sorted packing; only used to guess the LR schedule's length when
# neither max_steps nor schedule_steps is given.
PACKING_EFFICIENCY = 0.85

_LABELS = ["job_id", "run_name"]
STEP = Gauge("eagle3_trainer_step", "Optimizer steps done", _LABELS)
TOKENS = PromCounter("eagle3_trainer_tokens", "Real (unpadded) tokens trained on by this process's run", _LABELS)
LOSS = Gauge("eagle3_trainer_loss", "TTT loss of the last step (step-decay weighted sum)", _LABELS)
POSITION_LOSS = Gauge(
    "eagle3_trainer_position_loss", "Loss of draft position i at the last step", [*_LABELS, "position"]
)
POSITION_ACCURACY = Gauge(
    "eagle3_trainer_position_accuracy", "Top-1 accuracy of draft position i at the last step", [*_LABELS, "position"]
)
LEARNING_RATE = Gauge("eagle3_trainer_learning_rate", "Learning rate of the last step", _LABELS)
TOKENS_PER_SECOND = Gauge("eagle3_trainer_tokens_per_second", "Training tokens/s over the last log window", _LABELS)
HELDOUT_ACCEPTANCE = Gauge(
    "eagle3_trainer_heldout_simulated_acceptance_length", "Simulated acceptance length on held-out shards", _LABELS
)


class TrainConfig(BaseModel):
    """Every knob of a training run; saved in each checkpoint."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    run_name: str = Field(default="default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    model_path: str | None = Field(default=None, description="the target's HF folder; default: the job's")
    aux_layer_ids: list[int] | None = Field(default=None, description="what the drafter consumes; default: the job's")
    follow: bool = Field(default=False, description="keep taking shards as they are committed until the job ends")
    epochs: int = Field(default=1, ge=1)
    max_steps: int | None = Field(default=None, ge=1)
    max_seconds: float | None = Field(default=None, gt=0, description="time budget of this invocation")
    schedule_steps: int | None = Field(default=None, ge=1, description="LR schedule length; default max_steps")
    batch_tokens: int = Field(default=8192, ge=2, description="padded B x T of one micro-batch on one rank")
    max_length: int = Field(default=2048, ge=3, description="samples are truncated to this many tokens")
    grad_accum: int = Field(default=1, ge=1)
    lr: float = Field(default=1e-4, gt=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_ratio: float = Field(default=0.015, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = Field(default=0.5, gt=0)
    init_from_target: bool = Field(default=True, description="start lm_head/norm/fc from the target's (drafter.py)")
    ttt_length: int = Field(default=7, ge=1)
    step_decay: float = Field(default=0.8, gt=0)
    seed: int = 0
    heldout_fraction: float = Field(default=0.05, ge=0, lt=1)
    heldout_max_batches: int = Field(default=32, ge=0)
    checkpoint_every: int = Field(default=500, ge=1)
    keep_checkpoints: int = Field(default=3, ge=1)
    log_every: int = Field(default=10, ge=1)
    metrics_port: int | None = None
    cache_dir: str | None = Field(default=None, description="local sample cache; default {home}/trainer-cache")
    cache_budget_bytes: int = Field(default=20 * 1024**3, ge=0)
    io_threads: int = Field(default=4, ge=1)
    pool_tokens: int | None = Field(default=None, ge=1, description="tokens shuffled and packed together")
    sort_by_length: bool = True
    follow_block_s: float = Field(default=1.0, gt=0)
    device: Literal["auto", "cpu", "cuda"] = "auto"


# What a resumed run may change; everything else comes from the checkpoint, so the next steps are the same.
RESUME_OVERRIDES = frozenset(
    {
        "follow",
        "epochs",
        "max_steps",
        "max_seconds",
        "checkpoint_every",
        "keep_checkpoints",
        "log_every",
        "metrics_port",
        "cache_dir",
        "cache_budget_bytes",
        "io_threads",
        "model_path",
        "device",
        "heldout_max_batches",
        "follow_block_s",
    }
)


# ---------------------------------------------------------------------------------------------------------------------
# Storage keys of a run


def run_prefix(job_id: str, run_name: str) -> str:
    return f"{job_id}/trainer/{run_name}/"


def checkpoint_key(job_id: str, run_name: str, step: int) -> str:
    return f"{run_prefix(job_id, run_name)}checkpoints/step_{step:08d}.pt"


def latest_key(job_id: str, run_name: str) -> str:
    return f"{run_prefix(job_id, run_name)}checkpoints/latest.json"


def curves_key(job_id: str, run_name: str) -> str:
    return f"{run_prefix(job_id, run_name)}checkpoints/curves.html"


# ---------------------------------------------------------------------------------------------------------------------
# Processes and devices


@dataclass
class Runtime:
    """This process's place in the run: rank, world size, device, and a gloo group for small control messages."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    control_group: dist.ProcessGroup | None = None
    owns_process_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def close(self) -> None:
        if self.owns_process_group:
            dist.destroy_process_group()


def init_runtime(device: str = "auto") -> Runtime:
    """Join the torchrun process group when there is one (NCCL on GPUs, gloo on CPU)."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigurationError("device=cuda but no CUDA device is available")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch_device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(torch_device)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Runtime(device=torch_device)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=torch_device if use_cuda else None)
    # Control messages (shard lists, stop flags, metrics) are small CPU objects: gloo, whatever moves gradients.
    control = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    return Runtime(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        device=torch_device,
        control_group=control,
        owns_process_group=owns,
    )


# ---------------------------------------------------------------------------------------------------------------------
# The objective, the optimizer, the schedule: shared with bench/trainer_throughput.py


class TTTObjective(nn.Module):
    """The drafter and its TTT loss as one module, because DDP prepares gradient reduction in `forward`."""

    def __init__(self, drafter: Eagle3Drafter, target_head: TargetHead, *, ttt_length: int, step_decay: float) -> None:
        super().__init__()
        self.drafter, self.target_head = drafter, target_head
        self.ttt_length, self.step_decay = ttt_length, step_decay

    def forward(self, batch: Batch | None) -> TTTOutput | torch.Tensor:
        if batch is None:
            # A rank with nothing to train on in this micro-step still joins the gradient all-reduce: a zero loss
            # that touches every trainable parameter gives them all a zero gradient.
            params = [p for p in self.drafter.parameters() if p.requires_grad]
            return torch.stack([p.sum() for p in params]).sum() * 0.0
        return ttt_loss(self.drafter, self.target_head, batch, ttt_length=self.ttt_length, step_decay=self.step_decay)


def build_optimizer(drafter: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; norms (1-D weights) get no weight decay."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = all(p.is_cuda for p in params)  # one kernel for all parameters on GPU
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, fused=fused or None)


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_lr_ratio at total_steps, flat after."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, total_steps: int) -> LambdaLR:
    warmup = round(config.warmup_ratio * total_steps)
    return LambdaLR(
        optimizer,
        lambda step: lr_factor(step, warmup_steps=warmup, total_steps=total_steps, min_lr_ratio=config.min_lr_ratio),
    )


def autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on CUDA (fp32 master weights); CPU trains in plain fp32."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def place_models(drafter: Eagle3Drafter, target_head: TargetHead, device: torch.device) -> None:
    drafter.to(device=device, dtype=torch.float32)  # integer buffers (d2t, t2d) keep their dtype
    # The frozen target head is only read: bf16 on GPU halves its memory and time, fp32 on CPU.
    target_head.to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)


@dataclass
class StepResult:
    """One optimizer step's numbers, summed over its micro-batches and ranks."""

    micro_batches: int  # that had something to learn from
    loss: float  # mean over those micro-batches
    step_losses: list[float]  # per draft position, weighted by counted rows
    step_accuracies: list[float]
    tokens: int  # real (unpadded) tokens
    grad_norm: float
    stepped: bool  # False when no micro-batch had a gradient or the gradient was not finite


def train_step(
    model: nn.Module,
    batches: list[Batch | None],
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: LambdaLR,
    params: list[nn.Parameter],
    loss_scale: float,
    max_grad_norm: float,
    ttt_length: int,
    device: torch.device,
    control_group: dist.ProcessGroup | None = None,
) -> StepResult:
    """Forward/backward every micro-batch of this rank (None = placeholder), then clip and step.

    Under DDP (`model` a DistributedDataParallel) every rank must pass the same number of micro-batches.
    """
    distributed = isinstance(model, DistributedDataParallel)
    # sums: [micro_batches, loss, tokens, per-step correct x L, per-step loss*rows x L, per-step rows x L]
    sums = torch.zeros(3 + 3 * ttt_length, dtype=torch.float64)
    model.train()
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        if batch is not None and batch.input_ids.shape[1] < 3:
            batch = None  # too short to have a row to learn from (ttt_loss returns a loss without gradient)
        if batch is None and not distributed:
            continue
        sync = contextlib.nullcontext() if (last or not distributed) else model.no_sync()  # type: ignore[operator]
        with sync, autocast(device):
            if batch is None:
                loss = model(None)
            else:
                out = model(batch.to(device))
                loss = out.loss * loss_scale
                rows = torch.tensor(out.step_num_tokens, dtype=torch.float64)
                sums[0] += 1
                sums[1] += float(out.loss.detach())
                sums[2] += int(batch.attention_mask.sum())
                sums[3 : 3 + ttt_length] += torch.tensor(out.step_accuracies, dtype=torch.float64) * rows
                sums[3 + ttt_length : 3 + 2 * ttt_length] += torch.tensor(out.step_losses, dtype=torch.float64) * rows
                sums[3 + 2 * ttt_length :] += rows
        loss.backward()
    if control_group is not None or dist.is_initialized():
        dist.all_reduce(sums, group=control_group)
    count, rows = int(sums[0]), sums[3 + 2 * ttt_length :].clamp(min=1)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm) if count else torch.tensor(0.0)
    # Gradients are identical on every rank after the all-reduce, so every rank takes the same branch.
    stepped = count > 0 and bool(torch.isfinite(grad_norm))
    if stepped:
        optimizer.step()
        scheduler.step()
    elif count:
        logger.warning("non-finite gradient norm %s: step skipped", float(grad_norm))
    optimizer.zero_grad(set_to_none=True)
    return StepResult(
        micro_batches=count,
        loss=float(sums[1]) / max(count, 1),
        step_losses=(sums[3 + ttt_length : 3 + 2 * ttt_length] / rows).tolist(),
        step_accuracies=(sums[3 : 3 + ttt_length] / rows).tolist(),
        tokens=int(sums[2]),
        grad_norm=float(grad_norm),
        stepped=stepped,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints


def frozen_parameter_names(drafter: nn.Module) -> set[str]:
    return {name for name, p in drafter.named_parameters() if not p.requires_grad}


def trainable_state(drafter: nn.Module) -> dict[str, torch.Tensor]:
    """The drafter's state without its frozen parameters (the target's embedding, reloaded from the target)."""
    frozen = frozen_parameter_names(drafter)
    return {name: t.detach().cpu() for name, t in drafter.state_dict().items() if name not in frozen}


def load_trainable_state(drafter: nn.Module, state: dict[str, torch.Tensor], *, source: str) -> None:
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    not_frozen = set(missing) - frozen_parameter_names(drafter)
    if unexpected or not_frozen:
        raise ConfigurationError(
            f"{source}: drafter weights do not fit: missing {sorted(not_frozen)}, unexpected {sorted(unexpected)}"
        )


def parameters_sha256(drafter: nn.Module) -> str:
    """A fingerprint of the trainable weights, byte for byte (DDP ranks must agree exactly)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(trainable_state(drafter).items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def read_checkpoint(ref: str, storage: Storage) -> tuple[dict[str, Any], str]:
    """A checkpoint from a local .pt path, a storage key, a `latest.json` key, or a run prefix `JOB/trainer/RUN`.
    Returns the checkpoint and the key or path it was read from."""
    path = Path(ref)
    if path.suffix == ".pt" and path.is_file():
        data, source = path.read_bytes(), str(path)
    else:
        key = ref
        if not key.endswith(".pt"):
            latest = key if key.endswith("latest.json") else f"{key.rstrip('/')}/checkpoints/latest.json"
            try:
                key = json.loads(storage.get(latest))["key"]
            except ObjectNotFound as exc:
                raise ConfigurationError(f"checkpoint {ref!r}: no such file, key or run ({latest} missing)") from exc
        try:
            data, source = storage.get(key), key
        except ObjectNotFound as exc:
            raise ConfigurationError(f"checkpoint {ref!r}: {key} not found in {storage.url}") from exc
    # weights_only: a checkpoint in shared storage must never be able to run code when loaded.
    checkpoint = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ConfigurationError(f"checkpoint {source}: not a format-{CHECKPOINT_FORMAT} trainer checkpoint")
    return checkpoint, source


def drafter_from_checkpoint(
    checkpoint: dict[str, Any], *, model_path: str | Path | None = None, source: str = "checkpoint"
) -> tuple[Eagle3Drafter, TargetHead]:
    """The trained drafter (and the frozen target head) of a checkpoint, rebuilt around the target model."""
    target = Path(model_path or checkpoint["model_path"])
    saved = DrafterConfig(**checkpoint["drafter_config"])
    drafter, target_head = build_drafter(
        target, checkpoint_vocab_mapping(checkpoint), aux_layer_ids=saved.aux_layer_ids, init_from_target=False
    )
    if drafter.config != saved:
        raise ConfigurationError(
            f"{source}: the target at {target} gives drafter config {asdict(drafter.config)}, "
            f"but the checkpoint was trained as {asdict(saved)}"
        )
    load_trainable_state(drafter, checkpoint["drafter"], source=source)
    return drafter, target_head


def checkpoint_vocab_mapping(checkpoint: dict[str, Any]) -> VocabMapping:
    """The vocab mapping the drafter was trained with: its d2t/t2d buffers travel in the checkpoint."""
    state = checkpoint["drafter"]
    return VocabMapping(d2t=state["d2t"], t2d=state["t2d"], coverage=None, draft_vocab_size=state["d2t"].numel())


# ---------------------------------------------------------------------------------------------------------------------
# Training curves: a self-contained HTML page with inline SVG (no plotting package needed)

_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"]


def _svg_chart(title: str, steps: list[int], series: dict[str, list[float]], *, y_min: float | None = None) -> str:
    width, height, left, right, top, bottom = 720, 300, 60, 150, 30, 40
    values = [v for vs in series.values() for v in vs if math.isfinite(v)] or [0.0]
    lo = min(values) if y_min is None else y_min
    hi = max(max(values), lo + 1e-9)
    x_lo, x_hi = min(steps, default=0), max(max(steps, default=1), min(steps, default=0) + 1)

    def x(step: float) -> float:
        return left + (step - x_lo) / (x_hi - x_lo) * (width - left - right)

    def y(value: float) -> float:
        return top + (hi - value) / (hi - lo) * (height - top - bottom)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        f'font-size="11"><text x="{left}" y="18" font-size="13">{escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" fill="none" '
        'stroke="#999"/>',
    ]
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        value = lo + frac * (hi - lo)
        parts.append(f'<text x="{left - 4}" y="{y(value) + 4:.1f}" text-anchor="end">{value:.3g}</text>')
        step = x_lo + frac * (x_hi - x_lo)
        parts.append(f'<text x="{x(step):.1f}" y="{height - bottom + 15}" text-anchor="middle">{step:.0f}</text>')
    parts.append(f'<text x="{(width - right + left) / 2}" y="{height - 5}" text-anchor="middle">step</text>')
    for i, (name, vs) in enumerate(series.items()):
        color = _COLORS[i % len(_COLORS)]
        points = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in zip(steps, vs, strict=True) if math.isfinite(v))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>')
        legend_y = top + 14 * i + 8
        legend_x = width - right + 10
        parts.append(
            f'<line x1="{legend_x}" y1="{legend_y}" x2="{legend_x + 20}" y2="{legend_y}" stroke="{color}" '
            'stroke-width="2"/>'
        )
        parts.append(f'<text x="{legend_x + 25}" y="{legend_y + 4}">{escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def curves_html(history: list[dict[str, Any]], title: str) -> str:
    """Loss and per-position accuracy over steps, as one self-contained HTML page."""
    steps = [h["step"] for h in history]
    positions = len(history[0]["step_accuracies"]) if history else 0
    loss = _svg_chart("TTT loss", steps, {"loss": [h["loss"] for h in history]})
    accuracy = _svg_chart(
        "top-1 accuracy per draft position",
        steps,
        {f"position {i}": [h["step_accuracies"][i] for h in history] for i in range(positions)},
        y_min=0.0,
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title></head>"
        f"<body><h3>{escape(title)}</h3>{loss}<br>{accuracy}</body></html>"
    )


# ---------------------------------------------------------------------------------------------------------------------
# The run


def estimate_schedule_steps(job: JobRecord, config: TrainConfig, world_size: int) -> int:
    """The LR schedule's length when not given: the job's planned training tokens over tokens per step."""
    train_tokens = job.tokens_total * (1.0 - config.heldout_fraction) * config.epochs
    per_step = config.batch_tokens * config.grad_accum * world_size * PACKING_EFFICIENCY
    return max(1, math.ceil(train_tokens / per_step))


class Trainer:
    """One training run of one job (see `train`)."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        settings: Settings,
        runtime: Runtime,
        resume: bool = False,
        resume_from: str | None = None,
    ) -> None:
        self.runtime = runtime
        self.storage = open_storage(settings.storage_url, settings)
        checkpoint = self._find_checkpoint(config, resume=resume, resume_from=resume_from)
        if checkpoint is not None:
            config = self._resumed_config(TrainConfig.model_validate(checkpoint["train_config"]), config)
        self.config = config
        self.job = load_job(self.storage, config.job_id)
        self.model_path = Path(config.model_path or self.job.model.path)
        target_config = read_target_config(self.model_path)
        if checkpoint is not None:
            aux_layer_ids = checkpoint["drafter_config"]["aux_layer_ids"]
        else:
            aux_layer_ids = config.aux_layer_ids or self.job.aux_layer_ids
        self.expected = TargetSignature.from_model_config(target_config, aux_layer_ids)

        # Rank 0 alone reads the job's shard events; its answers are broadcast (a refusal included).
        self.follower: ShardFollower | None = self._on_rank0_or_raise(
            lambda: ShardFollower(
                self.job,
                storage=self.storage,
                expected=self.expected,
                redis_client=redis.Redis.from_url(settings.redis_url, socket_timeout=30) if config.follow else None,
                follow=config.follow,
                heldout_fraction=config.heldout_fraction,
                block_s=config.follow_block_s,
            )
        )
        source: ShardSource = (
            BroadcastShardSource(self.follower, runtime.control_group) if runtime.distributed else self.follower
        )  # type: ignore[assignment]

        # The model. Seeded identically on every rank; DDP also broadcasts rank 0's weights.
        torch.manual_seed(config.seed)
        mapping = load_vocab_mapping(
            self.storage.get(layout.vocab_mapping(config.job_id)), source=layout.vocab_mapping(config.job_id)
        )
        self.drafter, self.target_head = build_drafter(
            self.model_path, mapping, aux_layer_ids=aux_layer_ids, init_from_target=config.init_from_target
        )
        if checkpoint is not None:
            if asdict(self.drafter.config) != checkpoint["drafter_config"]:
                raise ConfigurationError(
                    f"checkpoint {self.checkpoint_source}: drafter config {checkpoint['drafter_config']} differs from "
                    f"{asdict(self.drafter.config)} built from {self.model_path} and job {config.job_id}"
                )
            load_trainable_state(self.drafter, checkpoint["drafter"], source=self.checkpoint_source)
        place_models(self.drafter, self.target_head, runtime.device)
        objective = TTTObjective(
            self.drafter, self.target_head, ttt_length=config.ttt_length, step_decay=config.step_decay
        )
        self.model: nn.Module = objective
        if runtime.distributed:
            # Buffers (d2t, t2d) never change, so there is nothing to broadcast before each forward.
            self.model = DistributedDataParallel(
                objective,
                device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None,
                forward_sync_buffers=False,
            )
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.drafter, config)
        if checkpoint is not None:
            self.schedule_steps = int(checkpoint["schedule_steps"])
        else:
            self.schedule_steps = (
                config.schedule_steps
                or config.max_steps
                or estimate_schedule_steps(self.job, config, runtime.world_size)
            )
        self.scheduler = build_scheduler(self.optimizer, config, self.schedule_steps)

        # The data.
        position = DataPosition(seed=config.seed)
        stats = DataStats()
        self.step, self.train_tokens, self.train_seconds = 0, 0, 0.0
        self.history: list[dict[str, Any]] = []
        if checkpoint is not None:
            position = DataPosition.model_validate(checkpoint["data_position"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            self.scheduler.load_state_dict(checkpoint["scheduler"])
            self.step = int(checkpoint["step"])
            self.train_tokens = int(checkpoint["train_tokens"])
            self.train_seconds = float(checkpoint["train_seconds"])
            self.history = list(checkpoint["history"])
            ranks = checkpoint["ranks"]
            if len(ranks) != runtime.world_size:
                logger.warning(
                    "checkpoint from %d processes resumed on %d: RNG streams start afresh",
                    len(ranks),
                    runtime.world_size,
                )
            if runtime.rank < len(ranks):
                _set_rng_state(ranks[runtime.rank]["rng"])
                stats = DataStats.from_dict(ranks[runtime.rank]["data_stats"])
        self.last_saved_step = self.step if checkpoint is not None else -1
        self.planner = BatchPlanner(
            source,
            batch_tokens=config.batch_tokens,
            max_length=config.max_length,
            epochs=config.epochs,
            position=position,
            pool_tokens=config.pool_tokens,
            sort_by_length=config.sort_by_length,
        )
        self.position = self.planner.position.model_copy(deep=True)  # as of the last trained group
        cache_root = Path(config.cache_dir) if config.cache_dir else settings.home / "trainer-cache"
        cache = (
            SampleCache(cache_root / config.job_id / f"rank{runtime.rank}", config.cache_budget_bytes)
            if config.cache_budget_bytes > 0
            else None
        )
        self.loader = SampleLoader(
            self.storage,
            job_id=config.job_id,
            hidden_size=self.expected.hidden_size,
            cache=cache,
            io_threads=config.io_threads,
            stats=stats,
        )
        self.labels = (config.job_id, config.run_name)

    # -- set-up helpers

    def _find_checkpoint(self, config: TrainConfig, *, resume: bool, resume_from: str | None) -> dict[str, Any] | None:
        self.checkpoint_source = ""
        if resume_from is None and not resume:
            return None
        if resume_from is None and not self.storage.exists(latest_key(config.job_id, config.run_name)):
            logger.info("run %s of job %s has no checkpoint yet: starting fresh", config.run_name, config.job_id)
            return None
        checkpoint, self.checkpoint_source = read_checkpoint(
            resume_from or latest_key(config.job_id, config.run_name), self.storage
        )
        if checkpoint["job_id"] != config.job_id:
            raise ConfigurationError(
                f"checkpoint {self.checkpoint_source} belongs to job {checkpoint['job_id']}, not {config.job_id}"
            )
        logger.info("resuming job %s from %s (step %d)", config.job_id, self.checkpoint_source, checkpoint["step"])
        return checkpoint

    def _resumed_config(self, saved: TrainConfig, given: TrainConfig) -> TrainConfig:
        """The saved config, with what a resumed run may change taken from the given one."""
        explicit = given.model_fields_set - {"job_id"}
        ignored = sorted(
            name for name in explicit - RESUME_OVERRIDES - {"run_name"} if getattr(given, name) != getattr(saved, name)
        )
        if ignored:
            logger.warning("resuming: %s kept from the checkpoint (the next steps must not change)", ignored)
        update = {name: getattr(given, name) for name in explicit & RESUME_OVERRIDES}
        return saved.model_copy(update={**update, "run_name": given.run_name})

    def _on_rank0_or_raise(self, make: Any) -> Any:
        """Run `make` on rank 0; if it raises a domain error, every rank raises it (no rank waits forever)."""
        result, error = None, None
        if self.runtime.rank == 0:
            try:
                result = make()
            except Eagle3Error as exc:
                error = exc
        if self.runtime.distributed:
            payload: list[object] = [error]
            dist.broadcast_object_list(payload, src=0, group=self.runtime.control_group)
            error = payload[0]  # type: ignore[assignment]
        if error is not None:
            raise error
        return result

    # -- collective decisions

    def _agree(self, flag: bool) -> bool:
        """True on every rank if it is True on any."""
        if not self.runtime.distributed:
            return flag
        value = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.runtime.control_group)
        return bool(value.item())

    def _gather(self, obj: Any) -> list[Any]:
        if not self.runtime.distributed:
            return [obj]
        gathered: list[Any] = [None] * self.runtime.world_size
        dist.all_gather_object(gathered, obj, group=self.runtime.control_group)
        return gathered

    # -- the loop

    def _next_group(self, out_of_time: Any) -> tuple[list[PlannedBatch], bool]:
        """The next group of planned micro-batches (shorter at the end of the data) and whether time ran out
        while waiting for shards."""
        group: list[PlannedBatch] = []
        size = self.config.grad_accum * self.runtime.world_size
        while len(group) < size:
            planned = self.planner.next_batch(block=True)
            if planned is None:
                break
            if planned == NOT_READY:
                if self._agree(out_of_time()):
                    return [], True
                continue
            group.append(planned)
        return group, False

    def run(self) -> dict[str, Any]:
        config, runtime = self.config, self.runtime
        if runtime.rank == 0 and config.metrics_port:
            start_http_server(config.metrics_port)
            logger.info("Prometheus metrics on port %d", config.metrics_port)
        started = time.monotonic()
        STEP.labels(*self.labels).set(self.step)

        def out_of_time() -> bool:
            return config.max_seconds is not None and time.monotonic() - started >= config.max_seconds

        stop_reason = "end_of_data"
        window: list[StepResult] = []
        window_started = time.monotonic()
        while True:
            if config.max_steps is not None and self.step >= config.max_steps:
                stop_reason = "max_steps"
                break
            if self._agree(out_of_time()):
                stop_reason = "max_seconds"
                break
            step_started = time.monotonic()
            group, timed_out = self._next_group(out_of_time)
            if timed_out:
                stop_reason = "max_seconds"
                break
            if not group:
                break
            result = self._train_group(group)
            self.position = self.planner.position.model_copy(deep=True)
            self.train_seconds += time.monotonic() - step_started
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
        if window:
            self._log_window(window, time.monotonic() - window_started)
        checkpoint = self._save_checkpoint() if self.step != self.last_saved_step else self._last_key()
        fingerprints = self._gather(parameters_sha256(self.drafter))
        if len(set(fingerprints)) != 1:
            logger.error("DDP ranks diverged: trainable weights differ (%s)", fingerprints)
        heldout = self._evaluate_heldout() if runtime.rank == 0 else {}
        stats = self._gather(self.loader.stats.as_dict())
        self.loader.close()
        last = self.history[-1] if self.history else {}
        summary = {
            "job_id": config.job_id,
            "run_name": config.run_name,
            "steps": self.step,
            "stop_reason": stop_reason,
            "train_tokens": self.train_tokens,
            "train_seconds": round(self.train_seconds, 3),
            "tokens_per_second": self.train_tokens / self.train_seconds if self.train_seconds else 0.0,
            "world_size": runtime.world_size,
            "final_loss": last.get("loss"),
            "final_step_accuracies": last.get("step_accuracies"),
            "checkpoint_key": checkpoint,
            "curves_key": curves_key(config.job_id, config.run_name),
            "data_position": self.position.model_dump(exclude={"epoch_shards"}),
            "skipped_samples": sum(s["skipped_samples"] for s in stats),
            "skipped_by_reason": dict(sum((Counter(s["skipped_by_reason"]) for s in stats), Counter())),
            "rank_parameter_sha256": fingerprints,
            "heldout": heldout,
            "history": self.history,
        }
        if runtime.rank == 0:
            logger.info(
                "run %s of job %s done (%s): %d steps, %d tokens in %.1fs, checkpoint %s",
                config.run_name,
                config.job_id,
                stop_reason,
                self.step,
                self.train_tokens,
                self.train_seconds,
                checkpoint,
            )
        return summary

    def _train_group(self, group: list[PlannedBatch]) -> StepResult:
        W, A = self.runtime.world_size, self.config.grad_accum
        mine = group[self.runtime.rank :: W]
        batches: list[Batch | None] = [self.loader.load(planned) for planned in mine]
        batches += [None] * (A - len(batches))  # placeholders: the last group may be short
        return train_step(
            self.model,
            batches,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            params=self.params,
            loss_scale=W / len(group),
            max_grad_norm=self.config.max_grad_norm,
            ttt_length=self.config.ttt_length,
            device=self.runtime.device,
            control_group=self.runtime.control_group,
        )

    def _publish(self, result: StepResult) -> None:
        STEP.labels(*self.labels).set(self.step)
        TOKENS.labels(*self.labels).inc(result.tokens)
        LOSS.labels(*self.labels).set(result.loss)
        LEARNING_RATE.labels(*self.labels).set(self.scheduler.get_last_lr()[0])
        for i, (step_loss, accuracy) in enumerate(zip(result.step_losses, result.step_accuracies, strict=True)):
            POSITION_LOSS.labels(*self.labels, str(i)).set(step_loss)
            POSITION_ACCURACY.labels(*self.labels, str(i)).set(accuracy)

    def _log_window(self, window: list[StepResult], seconds: float) -> None:
        """One history point (and one log line) per log window: means over its steps."""
        n = len(window)
        entry = {
            "step": self.step,
            "loss": sum(r.loss for r in window) / n,
            "step_losses": [sum(v) / n for v in zip(*(r.step_losses for r in window), strict=True)],
            "step_accuracies": [sum(v) / n for v in zip(*(r.step_accuracies for r in window), strict=True)],
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": sum(r.grad_norm for r in window) / n,
            "train_tokens": self.train_tokens,
            "tokens_per_second": sum(r.tokens for r in window) / max(seconds, 1e-9),
        }
        self.history.append(entry)
        TOKENS_PER_SECOND.labels(*self.labels).set(entry["tokens_per_second"])
        if self.runtime.rank == 0:
            logger.info(
                "step %d loss %.4f acc %s lr %.2e grad_norm %.3f %.0f tokens/s",
                self.step,
                entry["loss"],
                " ".join(f"{a:.3f}" for a in entry["step_accuracies"]),
                entry["lr"],
                entry["grad_norm"],
                entry["tokens_per_second"],
            )

    def _last_key(self) -> str | None:
        return (
            checkpoint_key(self.config.job_id, self.config.run_name, self.step) if self.last_saved_step >= 0 else None
        )

    def _save_checkpoint(self) -> str:
        config = self.config
        key = checkpoint_key(config.job_id, config.run_name, self.step)
        ranks = self._gather({"rng": _rng_state(), "data_stats": self.loader.stats.as_dict()})
        self.last_saved_step = self.step
        if self.runtime.rank != 0:
            return key
        payload = {
            "format": CHECKPOINT_FORMAT,
            "job_id": config.job_id,
            "run_name": config.run_name,
            "step": self.step,
            "saved_at": utc_now(),
            "model_path": str(self.model_path),
            "drafter": trainable_state(self.drafter),
            "drafter_config": asdict(self.drafter.config),
            "train_config": config.model_dump(mode="json"),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "schedule_steps": self.schedule_steps,
            "data_position": self.position.model_dump(),
            "ranks": ranks,
            "train_tokens": self.train_tokens,
            "train_seconds": self.train_seconds,
            "history": self.history,
        }
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        self.storage.put(key, buffer.getvalue())
        self.storage.put(
            latest_key(config.job_id, config.run_name),
            json.dumps({"key": key, "step": self.step, "saved_at": payload["saved_at"]}).encode(),
        )
        self.storage.put(
            curves_key(config.job_id, config.run_name),
            curves_html(self.history, f"{config.job_id} / {config.run_name}").encode(),
        )
        prefix = f"{run_prefix(config.job_id, config.run_name)}checkpoints/step_"
        for old in self.storage.list(prefix)[: -config.keep_checkpoints]:
            self.storage.delete(old)
        logger.info("checkpoint step %d -> %s (%d bytes)", self.step, key, buffer.tell())
        return key

    def _evaluate_heldout(self) -> dict[str, Any]:
        assert self.follower is not None
        manifests = self.follower.heldout_manifests()
        if not manifests or not self.config.heldout_max_batches:
            logger.warning("job %s: no committed held-out shard to evaluate on", self.config.job_id)
            return {}
        planned = plan_all(manifests, batch_tokens=self.config.batch_tokens, max_length=self.config.max_length)
        batches = heldout_batches(self.loader, planned[: self.config.heldout_max_batches], self.runtime.device)
        with autocast(self.runtime.device):
            metrics = evaluate.evaluate_heldout(self.drafter, self.target_head, batches, self.config.ttt_length)
        if "simulated_acceptance_length" in metrics:
            HELDOUT_ACCEPTANCE.labels(*self.labels).set(metrics["simulated_acceptance_length"])
        logger.info("held-out evaluation of job %s: %s", self.config.job_id, metrics)
        return metrics


def heldout_batches(loader: SampleLoader, planned: list[PlannedBatch], device: torch.device) -> Iterator[Batch]:
    for item in planned:
        batch = loader.load(item)
        if batch is not None:
            yield batch.to(device)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def train(
    config: TrainConfig, *, settings: Settings, resume: bool = False, resume_from: str | None = None
) -> dict[str, Any]:
    """Train a drafter on a job's committed shards; returns a summary (on every rank; rank 0's has the held-out
    metrics). Under torchrun, joins the process group itself."""
    runtime = init_runtime(config.device)
    try:
        return Trainer(config, settings=settings, runtime=runtime, resume=resume, resume_from=resume_from).run()
    finally:
        runtime.close()


# ---------------------------------------------------------------------------------------------------------------------
# A saved checkpoint: evaluation against an untrained baseline, and export


def heldout_prompts(batches: list[Batch], count: int) -> list[list[int]]:
    """Up to `count` distinct prompts: each held-out sample up to its first loss-masked token (the conversation
    before the first assistant reply)."""
    prompts: list[list[int]] = []
    for batch in batches:
        for input_ids, loss_mask, real in zip(batch.input_ids, batch.loss_mask, batch.attention_mask, strict=True):
            ids, mask = input_ids[real].tolist(), loss_mask[real].tolist()
            first = mask.index(1) if 1 in mask else 0
            if first > 0 and ids[:first] not in prompts:
                prompts.append(ids[:first])
            if len(prompts) == count:
                return prompts
    return prompts


def evaluate_checkpoint(
    ref: str,
    *,
    settings: Settings,
    job_id: str | None = None,
    model_path: str | None = None,
    num_prompts: int = 8,
    num_draft_tokens: int = 7,
    max_new_tokens: int = 64,
    max_batches: int | None = None,
) -> dict[str, Any]:
    """Held-out per-position accuracy, simulated acceptance length, and acceptance measured by greedy chain
    speculative decoding of the target, for the checkpoint's drafter and for an untrained one (same seed)."""
    from transformers import AutoModelForCausalLM

    storage = open_storage(settings.storage_url, settings)
    checkpoint, source = read_checkpoint(ref, storage)
    config = TrainConfig.model_validate(checkpoint["train_config"])
    target = Path(model_path or checkpoint["model_path"])
    drafter, target_head = drafter_from_checkpoint(checkpoint, model_path=target, source=source)
    torch.manual_seed(config.seed)  # the same initial weights the run started from
    untrained, _ = build_drafter(
        target,
        checkpoint_vocab_mapping(checkpoint),
        aux_layer_ids=drafter.config.aux_layer_ids,
        init_from_target=config.init_from_target,
    )
    job = load_job(storage, job_id or checkpoint["job_id"])
    expected = TargetSignature.from_model_config(read_target_config(target), drafter.config.aux_layer_ids)
    follower = ShardFollower(job, storage=storage, expected=expected, heldout_fraction=config.heldout_fraction)
    follower.poll(block=False)
    manifests = follower.heldout_manifests()
    if not manifests:
        raise ConfigurationError(f"job {job.job_id}: no committed held-out shard to evaluate on")
    planned = plan_all(manifests, batch_tokens=config.batch_tokens, max_length=config.max_length)
    loader = SampleLoader(storage, job_id=job.job_id, hidden_size=expected.hidden_size)
    try:
        batches = list(
            heldout_batches(loader, planned[: max_batches or config.heldout_max_batches], torch.device("cpu"))
        )
    finally:
        loader.close()
    trained_heldout = evaluate.evaluate_heldout(drafter, target_head, batches, config.ttt_length)
    untrained_heldout = evaluate.evaluate_heldout(untrained, target_head, batches, config.ttt_length)

    prompts = heldout_prompts(batches, num_prompts)
    target_model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    measured = evaluate.measure_acceptance(
        target_model, drafter, prompts, num_draft_tokens=num_draft_tokens, max_new_tokens=max_new_tokens
    )
    baseline = evaluate.measure_acceptance(
        target_model, untrained, prompts, num_draft_tokens=num_draft_tokens, max_new_tokens=max_new_tokens
    )
    return {
        "checkpoint": source,
        "job_id": job.job_id,
        "step": checkpoint["step"],
        "train_tokens": checkpoint["train_tokens"],
        "train_seconds": checkpoint["train_seconds"],
        "acc_per_position": trained_heldout["acc_per_position"],
        "simulated_acceptance_length": trained_heldout["simulated_acceptance_length"],
        "untrained_acc_per_position": untrained_heldout["acc_per_position"],
        "untrained_simulated_acceptance_length": untrained_heldout["simulated_acceptance_length"],
        "measured_acceptance_length": measured.mean_accepted_per_step,
        "untrained_measured_acceptance_length": baseline.mean_accepted_per_step,
        "matches_greedy": measured.matches_greedy and baseline.matches_greedy,
        "num_prompts": len(prompts),
        "num_draft_tokens": num_draft_tokens,
        "heldout": trained_heldout,
        "untrained_heldout": untrained_heldout,
        "acceptance": asdict(measured),
        "untrained_acceptance": asdict(baseline),
    }


def export_checkpoint(ref: str, out_dir: Path, *, settings: Settings, model_path: str | None = None) -> Path:
    """An SGLang EAGLE-3 draft model folder from a checkpoint."""
    storage = open_storage(settings.storage_url, settings)
    checkpoint, source = read_checkpoint(ref, storage)
    drafter, _ = drafter_from_checkpoint(checkpoint, model_path=model_path, source=source)
    return export.export_sglang(drafter, out_dir)

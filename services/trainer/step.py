"""One optimizer step of the EAGLE-3 objective: the drafter and its TTT loss as one module, AdamW, the warmup +
cosine schedule, and `train_step` (forward/backward over a rank's micro-batches, then clip and step).

Notable:
- One optimizer step trains one *group* of `grad_accum * world_size` planned micro-batches. Rank r takes
  micro-batches r, r + W, ... of the group, and each loss is scaled by W / len(group), so W processes compute the
  same update as one process with grad_accum * W (DDP averages gradients over ranks).
- A rank with fewer micro-batches than the others in the last group (or whose samples were all skipped) runs a
  zero-loss placeholder, so every rank joins every gradient all-reduce.
- bf16 autocast with fp32 master weights on CUDA; plain fp32 on CPU.

Shared with bench/trainer_throughput.py, which times exactly this step.
"""

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from services.trainer.config import TrainConfig
from services.trainer.drafter import Eagle3Drafter, TargetHead
from services.trainer.loss import Batch, TTTOutput, ttt_loss

logger = logging.getLogger(__name__)


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


def lr_factor(step: float, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_lr_ratio at total_steps, flat after."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class TrainClock:
    """Seconds spent training, over resumes (a checkpoint keeps them)."""

    seconds: float = 0.0


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: TrainConfig, total_steps: int, clock: TrainClock | None = None
) -> LambdaLR:
    """Warmup, then cosine decay over `total_steps`. A run bounded by time alone (max_seconds without max_steps or
    schedule_steps, given `clock`) decays as far as the further of its steps and its seconds: its LR reaches the
    minimum when the time runs out, however many steps the device managed."""
    warmup = round(config.warmup_ratio * total_steps)
    by_time = config.max_steps is None and config.schedule_steps is None
    timed = (clock, config.max_seconds) if clock is not None and config.max_seconds and by_time else None

    def factor(step: int) -> float:
        position = float(step)
        if timed is not None and step >= warmup:
            run_clock, budget = timed
            position = max(position, warmup + (total_steps - warmup) * min(1.0, run_clock.seconds / budget))
        return lr_factor(position, warmup_steps=warmup, total_steps=total_steps, min_lr_ratio=config.min_lr_ratio)

    return LambdaLR(optimizer, factor)


def autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on CUDA (fp32 master weights); CPU trains in plain fp32."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def place_models(drafter: Eagle3Drafter, target_head: TargetHead, device: torch.device) -> None:
    """The drafter's trained weights on `device` in fp32, the frozen target head there in bf16 on a GPU, and the frozen
    token embedding on the host: the loader looks the tokens up there (`loss.with_token_embeds`), so the table (1 GB
    at a 128K vocabulary and 4096 hidden) takes no GPU memory."""
    embedding = drafter.embed_tokens
    drafter.embed_tokens = None  # type: ignore[assignment]  # kept off the device while the rest moves
    drafter.to(device=device, dtype=torch.float32)  # integer buffers (d2t, t2d) keep their dtype
    # The frozen parts are only read: bf16 on GPU (the dtype targets ship in) halves their memory, and each unrolled
    # step then keeps its embeddings for backward in bf16; fp32 on CPU.
    frozen_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target_head.to(device=device, dtype=frozen_dtype)
    drafter.embed_tokens = embedding.to(device="cpu", dtype=frozen_dtype)


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


class StepOutOfMemory(torch.OutOfMemoryError):
    """The GPU ran out of memory in a micro-batch's forward or backward: the step applied nothing (still a torch
    OutOfMemoryError to code that catches that)."""


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
    # sums: [micro_batches, loss, tokens, per-step correct x L, per-step loss*rows x L, per-step rows x L]
    sums = torch.zeros(3 + 3 * ttt_length, dtype=torch.float64)
    model.train()
    try:
        _forward_backward(model, batches, sums, loss_scale=loss_scale, ttt_length=ttt_length, device=device)
    except torch.OutOfMemoryError as error:
        # Before the optimizer: nothing applied yet. The gradients so far go, so the same micro-batches can be trained
        # again from the start with less kept for backward.
        optimizer.zero_grad(set_to_none=True)
        raise StepOutOfMemory(str(error).splitlines()[0]) from error
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


def _forward_backward(
    model: nn.Module,
    batches: list[Batch | None],
    sums: torch.Tensor,
    *,
    loss_scale: float,
    ttt_length: int,
    device: torch.device,
) -> None:
    """Forward and backward of every micro-batch, gradients accumulating; the loss and accuracy sums into `sums`."""
    distributed = isinstance(model, DistributedDataParallel)
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        if batch is not None and batch.input_ids.shape[1] < 3:
            batch = None  # too short to have a row to learn from (ttt_loss returns a loss without gradient)
        if batch is None and not distributed:
            continue
        # isinstance, not `distributed`: the type checker narrows `model` (to DDP, which has no_sync) on the test alone.
        sync = model.no_sync() if isinstance(model, DistributedDataParallel) and not last else contextlib.nullcontext()
        with sync, autocast(device):
            if batch is None:
                loss = model(None)
            else:
                out = model(batch.to(device, non_blocking=True))  # from page-locked memory on a GPU (the loader's)
                loss = out.loss * loss_scale
                rows = torch.tensor(out.step_num_tokens, dtype=torch.float64)
                sums[0] += 1
                sums[1] += float(out.loss.detach())
                sums[2] += int(batch.attention_mask.sum())
                sums[3 : 3 + ttt_length] += torch.tensor(out.step_accuracies, dtype=torch.float64) * rows
                sums[3 + ttt_length : 3 + 2 * ttt_length] += torch.tensor(out.step_losses, dtype=torch.float64) * rows
                sums[3 + 2 * ttt_length :] += rows
        loss.backward()

"""Our EAGLE-3 training step against SpecForge's, on the same weights and the same inputs, in one command.

SpecForge's side is its own code (`specforge` 0.2.0): the draft model `LlamaForCausalLMEagle3` with its default
attention backend (flex_attention), `OnlineEagle3Model` (TTT), `Eagle3TrainStrategy` over its offline `TargetHead`
(the stored final state through the frozen lm_head, as its offline training reads it) and `BF16Optimizer` (bf16
weights, fp32 master copies, clipping at 0.5), on one GPU without FSDP. Ours is the trainer's own step
(`services.trainer.step`: `TTTObjective`, fused AdamW over fp32 weights under bf16 autocast, clipping at 0.5), with its
defaults. Both start from the same weights: SpecForge's model loads our drafter's state dict (same names; the SGLang
export is it, filtered).

1. Loss agreement, on one batch in fp32 with no autocast on either side, so that the comparison is of the objective
   and not of rounding. The two normalise differently, so the per-step sums of the soft cross-entropy are compared:
   SpecForge's step loss is a mean over all B*T rows (rows it masks add zero), ours a mean over the rows we count.
   SpecForge gates row t of step i on `loss_mask[t + i]`, ours on the mask of the token it predicts
   (`loss_mask[t + 2 + i]`), so SpecForge's batch gets our mask shifted left by two: the same rows count on both
   sides. Per-step accuracies are compared too (one argmax flipped by rounding moves them by 1/rows).
2. Our default (the compiled backbone on CUDA, as the trainer runs there) and our variants (--ours-variants: eager,
   the recomputing flags, the TTT attention's compiled merges) against the readable reference (the eager backbone,
   autograd through the logits and the eager loss), on the same batch in fp32: every trainable weight's gradient of
   the TTT loss must agree, or the rows are marked (a variant that is faster because its backward lost work is not
   faster: torch 2.11 once compiled the backbone into a backward that returned zeros).
3. Throughput and memory per batch shape: each side's whole optimizer step (forward, backward, clip, AdamW), the
   median of --steps timed steps after --warmup, and the peak of allocated GPU memory over them. A shape that runs out
   of memory on one side is named in the table; the other side is still measured. Each side starts from a GPU that
   holds nothing of the side before (garbage collected, and what is still allocated is recorded: `allocated_before_gib`,
   part of that side's peak), with its two batches on the GPU before its steps. Tokens/s counts every position of
   the batch, B*T. The batches (--inputs) have prompts and right padding by default, rows our step skips the
   vocabulary projections and the MLP on where no prediction counts, and SpecForge computes in full; with
   `--inputs learned` every position is real and learned, and neither side has work to skip.

    python -m bench.vs_specforge --dims llama3-8b --shapes 1x2048 4x2048 1x8192 2x16384 --out vs_specforge.json

On a CPU (`--dims tiny`, small shapes) it checks the agreement and runs the steps, so the script is tested without a
GPU; SpecForge's loss is a Triton kernel there, which runs under TRITON_INTERPRET=1 (tests/trainer/test_vs_specforge.py
runs it that way), and SpecForge's torch.compile'd helpers run eagerly (TORCHDYNAMO_DISABLE=1).
"""

import argparse
import copy
import gc
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.attention_kernels import attention_pass
from bench.memory_peak import format_breakdown, peak_breakdown, recorded_allocations
from bench.trainer_throughput import SHAPES, Shape, random_models, trainer_step
from services.trainer import drafter as drafter_module
from services.trainer import loss as loss_module
from services.trainer.config import TrainConfig, compiles_backbone
from services.trainer.drafter import Eagle3Drafter, TargetHead
from services.trainer.export import sglang_config
from services.trainer.loss import Batch, ttt_loss, with_token_embeds

DIMS = {
    "llama3-8b": SHAPES["llama3-8b"],
    "tiny": Shape(128, 256, 4, 2, 32, 1024, 256, ()),
}
# fp32 on both sides: what is left is summation order (flash vs flex attention, fused vs Triton cross-entropy).
LOSS_RTOL = 1e-3
ACCURACY_ATOL_ROWS = 2  # argmax flips between near-equal logits, counted in rows
# fp32 on both sides again, our own code: what is left is the order of sums (recomputation, compiled kernels).
GRADIENT_RTOL = 1e-3
AGREEMENT_BACKENDS = ("flex_attention", "sdpa")  # SpecForge's default attention, and the one it falls back to


@dataclass(frozen=True)
class Models:
    drafter: Eagle3Drafter
    target_head: TargetHead
    shape: Shape


def build_models(shape: Shape, seed: int = 0) -> Models:
    """The throughput benchmark's random drafter and target head, with the head's draft-vocabulary rows made larger
    so that most of the target's greedy tokens are in the draft vocabulary, as in a real one."""
    drafter, target_head = random_models(shape, seed)
    target_ids = drafter.d2t + torch.arange(shape.draft_vocab_size)
    target_head.weight.data[target_ids] *= 2
    return Models(drafter, target_head, shape)


INPUTS = ("masked", "learned")


def random_batch(shape: Shape, batch_size: int, seq_len: int, seed: int, *, inputs: str = "masked") -> Batch:
    """Random states at the scale of a post-norm residual stream. "masked": a loss mask with unlearned stretches
    (prompts) and right padding on all rows but the first, so that every mask path is exercised; "learned": every
    token real and learned, as in the loader benchmark's samples, where our step skips no row's work."""
    generator = torch.Generator().manual_seed(seed)
    B, T, H = batch_size, seq_len, shape.hidden_size
    lengths = torch.full((B,), T)
    prompt = torch.zeros(B, dtype=torch.long)
    if inputs == "masked":
        lengths[1:] = torch.randint(T // 2, T + 1, (B - 1,), generator=generator)
        prompt = torch.randint(0, max(1, T // 4), (B,), generator=generator)
    attention_mask = torch.arange(T)[None, :] < lengths[:, None]
    loss_mask = (torch.arange(T)[None, :] >= prompt[:, None]) & attention_mask
    return Batch(
        input_ids=torch.randint(0, shape.vocab_size, (B, T), generator=generator),
        loss_mask=loss_mask.long(),
        aux_hidden_state=torch.randn(B, T, 3 * H, generator=generator).to(torch.bfloat16),
        hidden_state=torch.randn(B, T, H, generator=generator).to(torch.bfloat16),
        attention_mask=attention_mask,
    )


# ----------------------------------------------------------------------------------------------------------
# SpecForge's side, built from its own classes


def import_specforge() -> None:
    """SpecForge's modules, imported first thing in `main`. Importing them keeps the importing frames alive, and with
    them (through each frame's caller) their locals: imported first in SpecForgeStep's constructor, the loss check's
    fp32 models (5.6 GiB on an H100) stayed on the GPU through every later side's measurement."""
    import specforge.algorithms.eagle3.model
    import specforge.modeling.draft.llama3_eagle
    import specforge.modeling.target.target_head
    import specforge.optimizer
    import specforge.runtime.contracts
    import specforge.training.strategies.base  # noqa: F401


class SpecForgeStep:
    """SpecForge's draft model, TTT model, strategy and target head over our drafter's weights."""

    def __init__(self, models: Models, *, device: torch.device, dtype: torch.dtype, attention_backend: str) -> None:
        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
        from specforge.modeling.target.target_head import TargetHead as SpecForgeTargetHead
        from specforge.training.strategies.base import Eagle3TrainStrategy
        from transformers import LlamaConfig

        config = LlamaConfig(**sglang_config(models.drafter.config))
        draft_model = LlamaForCausalLMEagle3(config, attention_backend=attention_backend)
        draft_model.load_state_dict(models.drafter.state_dict(), strict=True)
        draft_model.freeze_embedding()  # the target's embedding, frozen as in SpecForge's training
        self.draft_model = draft_model.to(device=device, dtype=dtype)
        with tempfile.TemporaryDirectory() as target_dir:  # its TargetHead reads the target's config from a folder
            LlamaConfig(
                hidden_size=models.shape.hidden_size, vocab_size=models.shape.vocab_size, num_hidden_layers=1
            ).save_pretrained(target_dir)
            target_head = SpecForgeTargetHead(target_dir)
        target_head.fc.weight.data.copy_(models.target_head.weight.data)
        target_head.requires_grad_(False)
        # Its from_pretrained keeps the head in bf16; fp32 for the agreement check.
        self.target_head = target_head.eval().to(device=device, dtype=dtype)
        self.eagle3_model = OnlineEagle3Model(
            draft_model=self.draft_model,
            length=TrainConfig(job_id="bench").ttt_length,
            attention_backend=attention_backend,
        )
        self.strategy = Eagle3TrainStrategy(self.eagle3_model, target_head=self.target_head)

    def forward(self, batch: Batch, device: torch.device) -> Any:
        from specforge.runtime.contracts import TrainBatch

        # SpecForge gates row t of step i on loss_mask[t + i]; ours gates on the predicted token, loss_mask[t + 2 + i].
        predictable = (batch.loss_mask.bool() & batch.attention_mask.bool()).long()
        train_batch = TrainBatch(
            sample_ids=[str(i) for i in range(batch.input_ids.shape[0])],
            strategy="eagle3",
            tensors={
                "input_ids": batch.input_ids.to(device),
                "attention_mask": batch.attention_mask.long().to(device),
                "loss_mask": F.pad(predictable[:, 2:], (0, 2)).to(device),  # shifted left by 2
                "hidden_state": batch.aux_hidden_state.to(device=device, dtype=self.target_head.fc.weight.dtype),
                "target": batch.hidden_state.to(device=device, dtype=self.target_head.fc.weight.dtype),
            },
            metadata={"target_repr": "hidden_state"},
        )
        return self.strategy.forward_loss(train_batch)


# ----------------------------------------------------------------------------------------------------------
# 1. Loss agreement


@torch.no_grad()
def loss_agreement(models: Models, batch: Batch, *, device: torch.device, attention_backend: str) -> dict:
    """Per-step sums of the soft cross-entropy and accuracies of both objectives on one batch, fp32, no autocast."""
    specforge = SpecForgeStep(models, device=device, dtype=torch.float32, attention_backend=attention_backend)
    B, T = batch.input_ids.shape
    theirs = specforge.forward(batch, device)
    their_sums = [float(loss) * B * T for loss in theirs.metrics["plosses"]]
    their_accuracies = [float(a) for a in theirs.metrics["acces"]]
    del specforge, theirs

    drafter = models.drafter.to(device)
    target_head = models.target_head.to(device)
    ours = ttt_loss(drafter, target_head, batch.to(device), ttt_length=len(their_sums))
    drafter.cpu()
    target_head.cpu()
    our_sums = [loss * rows for loss, rows in zip(ours.step_losses, ours.step_num_tokens, strict=True)]
    steps = []
    for i, (our_sum, their_sum) in enumerate(zip(our_sums, their_sums, strict=True)):
        rows = ours.step_num_tokens[i]
        relative = abs(our_sum - their_sum) / max(abs(their_sum), 1e-12)
        accuracy_gap = abs(ours.step_accuracies[i] - their_accuracies[i])
        steps.append(
            {
                "step": i,
                "rows": rows,
                "ours": our_sum,
                "specforge": their_sum,
                "relative_error": relative,
                "accuracy_ours": ours.step_accuracies[i],
                "accuracy_specforge": their_accuracies[i],
                "agree": relative <= LOSS_RTOL and accuracy_gap * max(rows, 1) <= ACCURACY_ATOL_ROWS,
            }
        )
    return {
        "batch": f"{B}x{T}",
        "specforge_attention": attention_backend,
        "precision": "fp32, no autocast",
        "tolerance": f"relative {LOSS_RTOL} on each step's loss sum; accuracy within {ACCURACY_ATOL_ROWS} rows",
        "steps": steps,
        "agree": all(s["agree"] for s in steps),
    }


# ----------------------------------------------------------------------------------------------------------
# 2. Throughput and memory


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(
    step: Callable[[int], None], *, device: torch.device, warmup: int, steps: int, origins: tuple[str, ...] = ()
) -> dict:
    """Median step time and peak allocated memory of `step(i)` over the timed steps; an OOM is returned, not raised.
    On a GPU, one more step with its allocations recorded: what is alive at its peak, by the line in `origins`'
    code that allocated it (bench/memory_peak.py)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    try:
        for i in range(warmup + steps):
            sync(device)
            started = time.perf_counter()
            step(i)
            sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - started)
    except torch.OutOfMemoryError as error:
        return {"error": "out of memory", "detail": str(error).splitlines()[0]}
    result: dict[str, Any] = {
        "step_s": statistics.median(times),
        "peak_gib": None,
        "step_ms_all": [round(t * 1e3, 1) for t in times],
    }
    if device.type != "cuda":
        return result
    # What stays allocated between steps (weights, gradients, optimizer state, the frozen embedding and head) against
    # the peak: the difference is what one step holds for itself (activations, logits, temporaries).
    resident = torch.cuda.memory_allocated(device) / 2**30
    result["peak_gib"] = peak = torch.cuda.max_memory_allocated(device) / 2**30
    result |= {"resident_gib": resident, "step_transient_gib": peak - resident}
    if origins:
        with recorded_allocations(device) as recording:
            step(warmup + steps)
        result["memory_at_peak"] = {
            "resident_bytes": recording.resident_bytes,
            **peak_breakdown(recording.trace, origins=origins),
        }
    return result


# Where a step's memory at its peak is attributed (bench/memory_peak.py): the first frame in this code.
OURS_ORIGINS = ("services/trainer/",)
SPECFORGE_ORIGINS = ("specforge/",)


@dataclass(frozen=True)
class OursVariant:
    """How our side is set up: the compiled backbone (None: as the trainer does on the device, compiled on CUDA and
    eager on the CPU), `eagle3 train --recompute-mlp`."""

    compile_backbone: bool | None = None
    recompute_mlp: bool = False
    # which kernels run the TTT attention's diagonal merges on CUDA (None: `drafter.MERGE_KERNELS_ON_CUDA` as it is)
    merge_kernels: str | None = None
    # the fused kernel of step 0's causal block on CUDA (None: `drafter.CAUSAL_BLOCK_KERNEL` as it is)
    causal_block_kernel: str | None = None
    # cuDNN reading the key-value heads as they are (None: `drafter.CUDNN_GROUPED_HEADS` as it is)
    cudnn_grouped_heads: bool | None = None
    # lm_head's weight gradient summed in fp32 by its matmuls (None: `loss.SUM_IN_FP32_ON_CUDA` as it is)
    head_sums_in_fp32: bool | None = None
    # the least share of a step's rows the MLP skips (None: `loss.MIN_SKIPPED_ROWS` as it is; 0: any)
    min_skipped_rows: float | None = None
    # which kernel computes each step's soft cross-entropy on CUDA (None: `loss.SOFT_CROSS_ENTROPY_ON_CUDA` as it is)
    soft_cross_entropy: str | None = None


# Ours as the trainer runs by default, and besides it on request (--ours-variants). "eager" is the readable reference
# every other variant's gradients are checked against.
OURS_DEFAULT = "default"
OURS_REFERENCE = "eager"
OURS_VARIANTS = {
    OURS_DEFAULT: OursVariant(),
    OURS_REFERENCE: OursVariant(compile_backbone=False),
    "compile": OursVariant(compile_backbone=True),
    "recompute_mlp": OursVariant(recompute_mlp=True),
    "compiled_merges": OursVariant(merge_kernels="compiled"),
    "eager_merges": OursVariant(merge_kernels="eager"),
    "flash_attention": OursVariant(causal_block_kernel="flash"),
    "cudnn_attention": OursVariant(causal_block_kernel="cudnn"),
    "repeated_kv_heads": OursVariant(cudnn_grouped_heads=False),
    "bf16_head_sums": OursVariant(head_sums_in_fp32=False),
    "mlp_skips_any_row": OursVariant(min_skipped_rows=0.0),
    "compiled_cross_entropy": OursVariant(soft_cross_entropy="compiled"),
}


@contextmanager
def ours_as(models: Models, variant: str, device: torch.device) -> Iterator[Eagle3Drafter]:
    """Our drafter set up as `variant` for `device`; a compiled one is a copy (the shared drafter stays eager for the
    rows after it), and the shared config's flags are reset afterwards."""
    setup = OURS_VARIANTS[variant]
    compiled = (
        setup.compile_backbone
        if setup.compile_backbone is not None
        else compiles_backbone(TrainConfig(job_id="bench"), device.type)
    )
    drafter = copy.deepcopy(models.drafter) if compiled else models.drafter
    if compiled:
        drafter.compile_backbone()
    drafter.config.recompute_mlp = setup.recompute_mlp
    # Module-level switches: (module, name, this variant's value or None for the default)
    switches = [
        (drafter_module, "MERGE_KERNELS_ON_CUDA", setup.merge_kernels),
        (drafter_module, "CAUSAL_BLOCK_KERNEL", setup.causal_block_kernel),
        (drafter_module, "CUDNN_GROUPED_HEADS", setup.cudnn_grouped_heads),
        (loss_module, "SUM_IN_FP32_ON_CUDA", setup.head_sums_in_fp32),
        (loss_module, "MIN_SKIPPED_ROWS", setup.min_skipped_rows),
        (loss_module, "SOFT_CROSS_ENTROPY_ON_CUDA", setup.soft_cross_entropy),
    ]
    defaults = [getattr(module, name) for module, name, _ in switches]
    for module, name, value in switches:
        if value is not None:
            setattr(module, name, value)
    try:
        yield drafter
    finally:
        drafter.config.recompute_mlp = False
        for (module, name, _), default in zip(switches, defaults, strict=True):
            setattr(module, name, default)
        # The weights (a compiled copy's too, whatever still refers to it) leave the GPU to the next side.
        for model in (drafter, models.drafter, models.target_head):
            model.cpu()


def settle(device: torch.device) -> dict[str, float]:
    """GiB allocated on the GPU before and after collecting garbage (0 on the CPU), before a side starts. What a side
    before it left in reference cycles is freed (only the collector frees those), and what is still allocated then is
    recorded: it is in this side's peak without being its own."""
    if device.type != "cuda":
        gc.collect()
        return {"allocated_uncollected_gib": 0.0, "allocated_before_gib": 0.0}
    torch.cuda.synchronize(device)
    uncollected = torch.cuda.memory_allocated(device) / 2**30
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "allocated_uncollected_gib": uncollected,
        "allocated_before_gib": torch.cuda.memory_allocated(device) / 2**30,
    }


def measure_ours(
    models: Models,
    batches: list[Batch],
    *,
    device: torch.device,
    warmup: int,
    steps: int,
    variant: str = OURS_DEFAULT,
    breakdown: bool = False,
) -> dict:
    before = settle(device)
    with ours_as(models, variant, device) as drafter:
        step = trainer_step(drafter, models.target_head, device, total_steps=warmup + steps + 1)
        # As on SpecForge's side the step, not the copy, is timed; the tokens' embeddings are looked up on the host, as
        # the trainer's loader does while the step before runs (SpecForge's step looks them up on the GPU).
        embedding = drafter.embed_tokens.weight.detach()
        on_device = [with_token_embeds(b, embedding).to(device) for b in batches]
        result = timed_steps(
            lambda i: step(on_device[i % len(on_device)]),
            device=device,
            warmup=warmup,
            steps=steps,
            origins=OURS_ORIGINS if breakdown else (),
        )
    return result | before  # the optimizer state goes with this call


def ttt_gradients(
    models: Models, batch: Batch, *, device: torch.device, variant: str, loss_implementation: str = "fused"
) -> dict[str, torch.Tensor]:
    """Every trainable weight's gradient of our TTT loss on `batch` (fp32, no autocast), our drafter as `variant`."""
    with ours_as(models, variant, device) as drafter:
        drafter.to(device)
        ttt_loss(
            drafter,
            models.target_head.to(device),
            batch.to(device),
            ttt_length=TrainConfig(job_id="bench").ttt_length,
            loss_implementation=loss_implementation,
        ).loss.backward()
        params = {name: p for name, p in drafter.named_parameters() if p.requires_grad}
        grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).cpu() for name, p in params.items()}
        drafter.zero_grad(set_to_none=True)
    return grads


# bf16 against fp32: the tolerance of the trainer's GPU test of the same attention (tests/trainer/test_drafter.py)
ATTENTION_RTOL = 2e-2


def attention_agreement(shape: Shape, kernel: str, device: torch.device, *, steps: int = 3, T: int = 1024) -> dict:
    """The fast TTT attention with `kernel` for step 0's block, in bf16, against the eager one in fp32 at the model's
    attention dims (one sequence of T, `steps` unrolled steps): the output and every input's gradient."""
    generator = torch.Generator(device).manual_seed(0)
    nh, nkv, D = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
    inputs = [torch.randn(1, nh, T, D, generator=generator, device=device)]
    inputs += [torch.randn(1, nkv, T, D, generator=generator, device=device) for _ in range(2 * steps)]
    grad_out = torch.randn(1, nh, T, D, generator=generator, device=device)

    got = attention_pass([x.bfloat16() for x in inputs], grad_out.bfloat16(), steps, kernel=kernel)
    ran = drafter_module.causal_block_kernel(inputs[0].bfloat16(), kernel)  # where the device lacks it, not `kernel`
    expected = attention_pass(inputs, grad_out, steps, attention=drafter_module.ttt_attention)  # fp32
    names = ["out", "query", *(f"key{j}" for j in range(steps)), *(f"value{j}" for j in range(steps))]
    errors = {name: float((a.float() - b).norm() / b.norm()) for name, a, b in zip(names, got, expected, strict=True)}
    worst = max(errors, key=errors.__getitem__)
    return {
        "kernel": kernel,
        "ran": ran,
        "relative_errors": errors,
        "worst": worst,
        "worst_relative_error": errors[worst],
        "tolerance": ATTENTION_RTOL,
        "agree": errors[worst] < ATTENTION_RTOL,
    }


def compare_gradients(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict:
    """Relative error ||got - expected|| / ||expected|| per weight, and whether all are within GRADIENT_RTOL."""
    errors = {
        name: float((got[name].float() - e.float()).norm() / e.float().norm().clamp_min(1e-30))
        for name, e in expected.items()
    }
    worst = max(errors, key=errors.__getitem__)
    return {
        "worst_weight": worst,
        "worst_relative_error": errors[worst],
        "tolerance": f"relative {GRADIENT_RTOL} on each weight's gradient (fp32, no autocast)",
        "agree": errors[worst] <= GRADIENT_RTOL,
        "relative_errors": errors,
    }


def measure_specforge(
    models: Models,
    batches: list[Batch],
    *,
    device: torch.device,
    warmup: int,
    steps: int,
    attention_backend: str,
    breakdown: bool = False,
) -> dict:
    from specforge.optimizer import BF16Optimizer

    before = settle(device)
    # bf16 weights with fp32 masters on GPU, as its trainer runs; fp32 on CPU, where bf16 matmuls crawl.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    specforge = SpecForgeStep(models, device=device, dtype=dtype, attention_backend=attention_backend)
    optimizer = BF16Optimizer(specforge.draft_model, lr=1e-4, max_grad_norm=0.5, total_steps=warmup + steps + 1)

    on_device = [b.to(device) for b in batches]  # as on our side: the step, not the copy, is timed

    def step(i: int) -> None:
        out = specforge.forward(on_device[i % len(on_device)], device)
        out.loss.backward()
        optimizer.step()

    origins = SPECFORGE_ORIGINS if breakdown else ()
    return timed_steps(step, device=device, warmup=warmup, steps=steps, origins=origins) | before


def print_agreement(agreement: dict) -> None:
    print(f"loss agreement at {agreement['batch']}, SpecForge's {agreement['specforge_attention']} attention:")
    header = ["step", "rows", "ours", "SpecForge", "rel. error", "acc ours", "acc SF"]
    print(" ".join(f"{h:>{w}s}" for h, w in zip(header, (4, 6, 12, 12, 10, 8, 8), strict=True)))
    for s in agreement["steps"]:
        print(
            f"{s['step']:4d} {s['rows']:6d} {s['ours']:12.4f} {s['specforge']:12.4f} {s['relative_error']:10.2e} "
            f"{s['accuracy_ours']:8.4f} {s['accuracy_specforge']:8.4f}{'' if s['agree'] else '  DISAGREE'}"
        )
    print(f"agree ({agreement['precision']}; {agreement['tolerance']}): {agreement['agree']}\n", flush=True)


def parse_shape(text: str) -> tuple[int, int]:
    batch_size, _, seq_len = text.partition("x")
    return int(batch_size), int(seq_len)


def against(theirs: dict, ours: dict) -> dict:
    """Ours over SpecForge: the speedup and the peak memory ratio, where both sides ran."""
    if "error" in ours or "error" in theirs:
        return {}
    ratios = {"speedup": theirs["step_s"] / ours["step_s"]}
    if ours["peak_gib"] is not None:
        # Each side's own peak: what was still allocated when it started (nothing of its own) left out.
        ratios["memory_ratio"] = own_peak(ours) / own_peak(theirs)
    return ratios


def own_peak(result: dict) -> float:
    return result["peak_gib"] - (result.get("allocated_before_gib") or 0.0)


def row(name: str, tokens: int, result: dict) -> str:
    if "error" in result:
        return f"{name:20s} {result['error']:>12s}"
    if result["peak_gib"] is None:
        memory = f"{'-':>9s} {'-':>11s}"
    else:
        memory = f"{result['peak_gib']:9.2f} {result['resident_gib']:11.2f}"
    before = result.get("allocated_before_gib") or 0.0
    garbage = (result.get("allocated_uncollected_gib") or 0.0) - before
    left = f"  ({garbage:.2f} GiB of garbage collected before it)" if garbage > 0.05 else ""
    left += f"  ({before:.2f} GiB still allocated when it started)" if before > 0.05 else ""
    return f"{name:20s} {tokens / result['step_s']:12.0f} {result['step_s'] * 1e3:10.1f} {memory}{left}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", choices=sorted(DIMS), default="llama3-8b")
    parser.add_argument("--shapes", nargs="*", default=["1x2048", "4x2048", "1x8192", "2x16384"], help="BxT")
    parser.add_argument("--agreement-shape", default="2x512", help="BxT of the fp32 loss agreement check")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--specforge-attention", default="flex_attention", help="SpecForge's attention backend")
    parser.add_argument(
        "--ours-variants", nargs="*", choices=OURS_VARIANTS, default=[], help="ours besides the defaults, per shape"
    )
    parser.add_argument(
        "--agreement-backends", nargs="+", default=list(AGREEMENT_BACKENDS), help="SpecForge attentions to check"
    )
    parser.add_argument(
        "--memory-breakdown",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a GPU, one more step per side and shape with its allocations recorded: what is alive at the peak",
    )
    parser.add_argument(
        "--inputs",
        choices=INPUTS,
        default="masked",
        help="the timed batches: masked (prompts and right padding: rows our step skips work on) or learned (every "
        "token real and learned); tokens/s counts every position, padding included, on both sides",
    )
    parser.add_argument("--out", type=Path, required=True, help="write the results as JSON here (after every shape)")
    args = parser.parse_args()
    import_specforge()

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    shape = DIMS[args.dims]
    models = build_models(shape)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()})",
        "torch": torch.__version__,
        "specforge": _version("specforge"),
        "python": platform.python_version(),
        "dims": {"name": args.dims, **asdict(shape)},
        "specforge_attention": args.specforge_attention,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "inputs": args.inputs,
        "shapes": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    B, T = parse_shape(args.agreement_shape)
    agreement_batch = random_batch(shape, B, T, seed=1)
    report["agreement"] = []
    for backend in args.agreement_backends:
        agreement = loss_agreement(models, agreement_batch, device=device, attention_backend=backend)
        report["agreement"].append(agreement)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print_agreement(agreement)

    # Our default (compiled on CUDA) and each variant against the readable reference, the eager backbone with the
    # eager loss (autograd through the logits): every weight's gradient.
    reference = ttt_gradients(
        models, agreement_batch, device=device, variant=OURS_REFERENCE, loss_implementation="eager"
    )
    report["gradient_agreement"] = {}
    for name in dict.fromkeys((OURS_DEFAULT, *args.ours_variants, OURS_REFERENCE)):
        got = ttt_gradients(models, agreement_batch, device=device, variant=name)
        report["gradient_agreement"][name] = check = compare_gradients(reference, got)
        verdict = "agree" if check["agree"] else "DISAGREE: its rows below are not a measure"
        print(
            f"ours ({name}) against the eager backbone and loss, every weight's gradient at {args.agreement_shape} "
            f"(fp32): worst {check['worst_relative_error']:.1e} ({check['worst_weight']}), {verdict}",
            flush=True,
        )
    if device.type == "cuda":
        # The gradients above are fp32, which no fused attention kernel takes: each causal-block kernel the rows below
        # use is checked here in bf16, at the model's attention dims, against the eager TTT attention in fp32.
        report["attention_agreement"] = {}
        for variant in dict.fromkeys((OURS_DEFAULT, *args.ours_variants)):
            kernel = OURS_VARIANTS[variant].causal_block_kernel or drafter_module.CAUSAL_BLOCK_KERNEL
            if kernel not in report["attention_agreement"]:
                report["attention_agreement"][kernel] = check = attention_agreement(shape, kernel, device)
                print(
                    f"the TTT attention with the {kernel} kernel (bf16; {check['ran']} ran) against the eager one "
                    "(fp32), output and every "
                    f"input's gradient: worst {check['worst_relative_error']:.1e} ({check['worst']}), "
                    + ("agree" if check["agree"] else "DISAGREE"),
                    flush=True,
                )
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print()

    print(f"{'shape':8s} {'side':20s} {'tokens/s':>12s} {'step ms':>10s} {'peak GiB':>9s} {'resident GiB':>11s}")
    for text in args.shapes:
        B, T = parse_shape(text)
        batches = [random_batch(shape, B, T, seed, inputs=args.inputs) for seed in (2, 3)]
        learned = sum(int(batch.loss_mask.sum()) for batch in batches) / (len(batches) * B * T)
        breakdown = args.memory_breakdown and device.type == "cuda"
        ours = measure_ours(models, batches, device=device, warmup=args.warmup, steps=args.steps, breakdown=breakdown)
        variants = {
            name: measure_ours(models, batches, device=device, warmup=args.warmup, steps=args.steps, variant=name)
            for name in dict.fromkeys(args.ours_variants)
            if name != OURS_DEFAULT
        }
        theirs = measure_specforge(
            models,
            batches,
            device=device,
            warmup=args.warmup,
            steps=args.steps,
            attention_backend=args.specforge_attention,
            breakdown=breakdown,
        )
        entry: dict[str, Any] = {
            "shape": text,
            "learned_fraction": learned,
            "ours": ours,
            "specforge": theirs,
            **against(theirs, ours),
        }
        if variants:
            entry["ours_variants"] = {name: result | against(theirs, result) for name, result in variants.items()}
        report["shapes"].append(entry)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        tokens = B * T
        print(f"{text:8s} ({learned:.0%} of the positions learned)")
        for name, result in {OURS_DEFAULT: ours, **variants}.items():
            check = report["gradient_agreement"].get(name)
            unchecked = "" if check is None or check["agree"] else "  (gradients DISAGREE)"
            label = "ours" if name == OURS_DEFAULT else f"ours ({name})"
            print(f"{'':8s} {row(label, tokens, result)}{unchecked}")
        print(f"{'':8s} {row('SpecForge', tokens, theirs)}")
        if "speedup" in entry:
            memory = f", peak memory {entry['memory_ratio']:.2f}x" if "memory_ratio" in entry else ""
            print(f"{'':8s} ours {entry['speedup']:.2f}x SpecForge's tokens/s{memory}", flush=True)
        for side, result in (("ours", ours), ("SpecForge", theirs)):
            if "memory_at_peak" in result:
                at_peak = result["memory_at_peak"]
                print(format_breakdown(f"{text} {side}", at_peak["resident_bytes"], at_peak), flush=True)


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()

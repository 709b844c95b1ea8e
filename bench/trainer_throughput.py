"""Drafter training throughput: tokens/s of the trainer's own optimizer step (TTT forward and backward, clipping,
AdamW) on random data, at a model's dimensions and batch shapes. Median of several timed steps after warm-up.

Shapes:
- llama3-8b: Llama-3.1-8B (hidden 4096, intermediate 14336, 32/8 heads, target vocab 128256, draft vocab 32000),
  batches 1x2048 and 4x2048, TTT 7: the shape of SpecForge's anchor (17.5K / 24.2K tokens/s on one H100,
  docs/benchmarks.md). CUDA only.
- smollm2-135m: SmolLM2-135M, the CPU demo's target (hidden 576, 9/3 heads, target vocab 49152, draft 32000).
- smollm2-gpu: the GPU demo's drafter of SmolLM2 (draft vocab 16384) at its batch of 32,768 tokens and at two and
  four times that, as samples of 512 tokens (its conversations average about 500).
- small: a small CPU shape for a quick look.

    python -m bench.trainer_throughput [--shapes smollm2-135m small] [--steps 5] --out result.json
    python -m bench.trainer_throughput --shapes smollm2-135m --draft-vocab-sizes 8192 2048 --out result.json
    python -m bench.trainer_throughput --shapes smollm2-gpu [--compile-backbone] --out result.json

On CUDA one more step runs under torch.profiler: the share of its wall time the GPU spent in kernels, and how many it
launched. A share far below 1 says the step is bound by its Python and kernel launches, not by the GPU: a small
drafter's step costs about as many launches as a large one's.
"""

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from services.trainer.config import TrainConfig
from services.trainer.drafter import DrafterConfig, Eagle3Drafter, TargetHead
from services.trainer.loss import Batch, with_token_embeds
from services.trainer.step import TTTObjective, build_optimizer, build_scheduler, place_models, train_step


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    batches: tuple[tuple[int, int], ...]  # (B, T) per measurement


SHAPES = {
    "llama3-8b": Shape(4096, 14336, 32, 8, 128, 128256, 32000, ((1, 2048), (4, 2048))),
    "smollm2-135m": Shape(576, 1536, 9, 3, 64, 49152, 32000, ((1, 512), (4, 512))),
    "smollm2-gpu": Shape(576, 1536, 9, 3, 64, 49152, 16384, ((64, 512), (128, 512), (256, 512))),
    "small": Shape(256, 768, 4, 2, 64, 8192, 4096, ((1, 512), (4, 512))),
}


def drafter_config(shape: Shape) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        vocab_size=shape.vocab_size,
        draft_vocab_size=shape.draft_vocab_size,
        target_hidden_size=shape.hidden_size,
        aux_layer_ids=[1, 15, 28],
    )


def random_batch(shape: Shape, batch_size: int, seq_len: int, generator: torch.Generator) -> Batch:
    # B batch, T sequence length, H target hidden size; hidden states at the scale of a post-norm residual stream
    B, T, H = batch_size, seq_len, shape.hidden_size
    return Batch(
        input_ids=torch.randint(0, shape.vocab_size, (B, T), generator=generator),
        loss_mask=torch.ones(B, T, dtype=torch.long),
        aux_hidden_state=torch.randn(B, T, 3 * H, generator=generator).to(torch.bfloat16),
        hidden_state=torch.randn(B, T, H, generator=generator).to(torch.bfloat16),
        attention_mask=torch.ones(B, T, dtype=torch.bool),
    )


def random_models(shape: Shape, seed: int = 0) -> tuple[Eagle3Drafter, TargetHead]:
    """A fresh drafter with a random draft vocabulary (sorted target ids, as vocab_mapping.pt would give) and a random
    target head, in fp32 on the CPU."""
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(drafter_config(shape))
    target_ids = torch.randperm(shape.vocab_size)[: shape.draft_vocab_size].sort().values
    drafter.d2t.copy_(target_ids - torch.arange(shape.draft_vocab_size))
    drafter.t2d.zero_()
    drafter.t2d[target_ids] = True
    return drafter, TargetHead(torch.randn(shape.vocab_size, shape.hidden_size) * 0.02)


def trainer_step(
    drafter: Eagle3Drafter,
    target_head: TargetHead,
    device: torch.device,
    total_steps: int,
    *,
    compile_backbone: bool = False,
) -> Callable[[Batch], None]:
    """The trainer's own optimizer step on one micro-batch (its placement, TTT objective, AdamW, schedule and
    clipping, at TrainConfig's defaults), with the models placed on `device`."""
    config = TrainConfig(job_id="bench", lr=1e-4)
    place_models(drafter, target_head, device)
    if compile_backbone:
        drafter.compile_backbone()
    objective = TTTObjective(drafter, target_head, ttt_length=config.ttt_length, step_decay=config.step_decay)
    optimizer = build_optimizer(drafter, config)
    scheduler = build_scheduler(optimizer, config, total_steps=total_steps)
    params = [p for p in drafter.parameters() if p.requires_grad]

    def step(batch: Batch) -> None:
        train_step(
            objective,
            [batch],
            optimizer=optimizer,
            scheduler=scheduler,
            params=params,
            loss_scale=1.0,
            max_grad_norm=config.max_grad_norm,
            ttt_length=config.ttt_length,
            device=device,
        )

    return step


def measure(
    shape: Shape,
    batch_size: int,
    seq_len: int,
    *,
    device: torch.device,
    warmup: int,
    steps: int,
    compile_backbone: bool = False,
) -> dict:
    drafter, target_head = random_models(shape)
    step = trainer_step(drafter, target_head, device, total_steps=warmup + steps + 1, compile_backbone=compile_backbone)
    generator = torch.Generator().manual_seed(0)
    # The tokens' embeddings looked up on the host, as the trainer's loader does while the step before runs.
    embedding = drafter.embed_tokens.weight.detach()
    batches = [with_token_embeds(random_batch(shape, batch_size, seq_len, generator), embedding) for _ in range(2)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(warmup + steps):
        batch = batches[i % len(batches)].to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        step(batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - started)
    step_s = statistics.median(times)
    peak_gib = round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
    profiled = profiled_step(step, batches[0].to(device)) if device.type == "cuda" else {}
    return {
        "batch_size": batch_size,
        "seq_len": seq_len,
        "step_ms": round(step_s * 1000, 2),
        "tokens_per_s": round(batch_size * seq_len / step_s, 1),
        "peak_gpu_memory_gib": peak_gib,
        "trainable_params": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
        "step_ms_all": [round(t * 1000, 2) for t in times],
        **profiled,
    }


def profiled_step(step: Callable[[Batch], None], batch: Batch) -> dict:
    """One step under torch.profiler: its wall time, the time the GPU spent in its kernels, and their number."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        step(batch)
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - started
    kernels = [event for event in prof.events() if event.device_type == DeviceType.CUDA]
    kernel_s = sum(event.time_range.elapsed_us() for event in kernels) / 1e6
    return {
        "profiled_step_ms": round(wall_s * 1000, 2),
        "kernel_ms": round(kernel_s * 1000, 2),
        "gpu_busy": round(kernel_s / wall_s, 3),
        "kernels": len(kernels),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="default: llama3-8b on CUDA, else CPU ones")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument(
        "--draft-vocab-sizes", type=int, nargs="+", help="measure each shape at these draft vocabularies instead"
    )
    parser.add_argument("--compile-backbone", action="store_true", help="the drafter's backbone compiled (CUDA)")
    parser.add_argument("--out", type=Path, required=True, help="write the results as JSON here")
    args = parser.parse_args()

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = args.shapes or (["llama3-8b"] if use_cuda else ["smollm2-135m", "small"])
    results = []
    for name in shapes:
        for draft_vocab_size in args.draft_vocab_sizes or [SHAPES[name].draft_vocab_size]:
            shape = replace(SHAPES[name], draft_vocab_size=draft_vocab_size)
            for batch_size, seq_len in shape.batches:
                measured = measure(
                    shape,
                    batch_size,
                    seq_len,
                    device=device,
                    warmup=args.warmup,
                    steps=args.steps,
                    compile_backbone=args.compile_backbone,
                )
                result = {"shape": name, "draft_vocab_size": draft_vocab_size, **measured}
                results.append(result)
                busy = ""
                if "gpu_busy" in result:
                    busy = f"  GPU busy {result['gpu_busy']:.0%} ({result['kernels']} kernels)"
                print(
                    f"{name:14s} draft {draft_vocab_size:6d} {batch_size}x{seq_len:<5d} step {result['step_ms']:9.1f} "
                    f"ms  {result['tokens_per_s']:10.0f} tokens/s  peak {result['peak_gpu_memory_gib']} GiB{busy}",
                    flush=True,
                )
    report = {
        "device": torch.cuda.get_device_name(device) if use_cuda else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "ttt_length": TrainConfig(job_id="bench").ttt_length,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "compile_backbone": args.compile_backbone,
        "shapes": {name: asdict(SHAPES[name]) for name in shapes},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""TTT training-step profile of the drafter's eager and fast paths, at Llama-3.1-8B dimensions, on one CUDA GPU.

Compares, on random data (no model files: the embedding and the target head are random tensors):
- parity: the sdpa TTT attention and the fused soft cross-entropy against their eager references (bf16 vs fp32),
  and the whole TTT loss and gradients of each variant against the eager one on the same weights and batch;
- throughput: one optimizer step (bf16 autocast, fp32 master weights, TTT 7, clip 0.5, fused AdamW), median of
  the timed steps after warm-up, and peak GPU memory, at 1x2048 and 4x2048 by default (--shapes), the shapes of
  SpecForge's anchor (17.5K / 24.2K tokens/s on one H100, docs/benchmarks.md);
- a torch.profiler table of one step at each shape, and its kernel time by kind (matmuls, attention, compiled
  kernels, ...).

Variants: eager (eager attention, eager loss), fast (sdpa attention, fused loss, the TTT attention's diagonal merges
as Triton kernels), fast+compile (fast plus `Eagle3Drafter.compile_backbone`: the trainer's default on CUDA),
fast+compile+compiled-merge and fast+compile+eager-merge (that with the merges compiled by Inductor, or as written).
It imports only torch and the trainer's drafter and
loss modules, and writes JSON after every measurement, so a run cut short still leaves its numbers.

    PYTHONUNBUFFERED=1 python -m bench.ttt_step_profile --out /tmp/ttt_step_profile
"""

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path

import torch

from services.trainer import drafter as drafter_module
from services.trainer import loss as loss_module
from services.trainer.drafter import DrafterConfig, Eagle3Drafter, TargetHead, ttt_attention, ttt_attention_sdpa
from services.trainer.loss import Batch, soft_cross_entropy, soft_cross_entropy_kernel, ttt_loss

TTT_LENGTH = 7
SHAPES = [(1, 2048), (4, 2048)]
DEVICE = torch.device("cuda")  # --smoke: a tiny model on the CPU, to check this script without a GPU
SPECFORGE_TOKENS_PER_S = {(1, 2048): 17532, (4, 2048): 24187}  # docs/benchmarks.md, one H100
# name: (attn_implementation, loss_implementation, compile_backbone, the TTT attention's merges on CUDA)
VARIANTS = {
    "eager": ("eager", "eager", False, "eager"),
    "fast": ("sdpa", "fused", False, "triton"),
    "fast+compile": ("sdpa", "fused", True, "triton"),
    # the TTT attention's diagonal merges compiled by Inductor or as written (`drafter.MERGE_KERNELS_ON_CUDA`)
    "fast+compile+compiled-merge": ("sdpa", "fused", True, "compiled"),
    "fast+compile+eager-merge": ("sdpa", "fused", True, "eager"),
}


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def free_cached_memory() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


def smoke_config() -> DrafterConfig:
    return DrafterConfig(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        vocab_size=2048,
        draft_vocab_size=512,
        target_hidden_size=256,
        aux_layer_ids=[1, 15, 28],
    )


def llama3_8b_config() -> DrafterConfig:
    return DrafterConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        vocab_size=128256,
        draft_vocab_size=32000,
        target_hidden_size=4096,
        aux_layer_ids=[1, 15, 28],
    )


def build_models(device: torch.device) -> tuple[Eagle3Drafter, TargetHead]:
    torch.manual_seed(0)
    config = llama3_8b_config() if device.type == "cuda" else smoke_config()
    with device:  # initialise on the GPU: ~1B parameters
        drafter = Eagle3Drafter(config)
        target_ids = torch.randperm(config.vocab_size)[: config.draft_vocab_size].sort().values  # a random draft vocab
        drafter.d2t.copy_(target_ids - torch.arange(config.draft_vocab_size))
        drafter.t2d.zero_()
        drafter.t2d[target_ids] = True
        target_head = TargetHead((torch.randn(config.vocab_size, config.hidden_size) * 0.02).to(torch.bfloat16))
    return drafter, target_head


def random_batch(config: DrafterConfig, B: int, T: int, device: torch.device, seed: int) -> Batch:
    generator = torch.Generator(device).manual_seed(seed)
    H = config.hidden_size
    return Batch(
        input_ids=torch.randint(0, config.vocab_size, (B, T), generator=generator, device=device),
        loss_mask=torch.ones(B, T, dtype=torch.long, device=device),
        aux_hidden_state=torch.randn(B, T, 3 * H, generator=generator, device=device).to(torch.bfloat16),
        hidden_state=torch.randn(B, T, H, generator=generator, device=device).to(torch.bfloat16),
        attention_mask=torch.ones(B, T, dtype=torch.bool, device=device),
    )


def set_variant(drafter: Eagle3Drafter, name: str) -> str:
    """Switch a built drafter to a variant; returns its loss_implementation. Compiling is undone for the variants
    without it by setting the modules' compiled call aside (nn.Module.compile keeps it in `_compiled_call_impl`)."""
    attn_implementation, loss_implementation, compile_backbone, merge_kernels = VARIANTS[name]
    drafter.config.attn_implementation = attn_implementation
    drafter_module.MERGE_KERNELS_ON_CUDA = merge_kernels
    modules = (drafter.midlayer, drafter.norm)
    if compile_backbone and not hasattr(drafter, "compiled_calls"):
        drafter.compile_backbone()
        drafter.compiled_calls = [module._compiled_call_impl for module in modules]  # type: ignore[attr-defined]
    for module, compiled_call in zip(modules, getattr(drafter, "compiled_calls", [None, None]), strict=True):
        module._compiled_call_impl = compiled_call if compile_backbone else None
    return loss_implementation


def build_optimizer(drafter: Eagle3Drafter) -> tuple[torch.optim.AdamW, list[torch.nn.Parameter]]:
    params = [p for p in drafter.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=1e-4, fused=DEVICE.type == "cuda"), params


def train_step(drafter, target_head, batch, optimizer, params, loss_implementation: str) -> float:
    """What the trainer's step does on one micro-batch: forward under bf16 autocast, backward, clip, AdamW."""
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = ttt_loss(drafter, target_head, batch, ttt_length=TTT_LENGTH, loss_implementation=loss_implementation)
    loss = float(out.loss.detach())  # the trainer logs it (one sync, as there)
    out.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
    if bool(torch.isfinite(grad_norm)):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-30))


def attention_outputs(attention, tensors: list, grad_out: torch.Tensor, steps: int, dtype: torch.dtype) -> list:
    """Output and input gradients of a TTT attention function on (query, keys..., values...) cast to dtype."""
    inputs = [x.to(dtype).requires_grad_() for x in tensors]
    out = attention(inputs[0], inputs[1 : 1 + steps], inputs[1 + steps :], None, inputs[0].shape[-1] ** -0.5)
    return [out, *torch.autograd.grad(out, inputs, grad_out.to(dtype))]


def attention_parity(device: torch.device) -> dict:
    """bf16 eager and sdpa TTT attention against the fp32 eager reference on the same random inputs."""
    result: dict = {}
    B, nh, nkv, T, D = (2, 32, 8, 1024, 128) if device.type == "cuda" else (1, 4, 2, 64, 64)
    for steps in (1, 4):
        generator = torch.Generator(device).manual_seed(steps)
        query = torch.randn(B, nh, T, D, generator=generator, device=device)
        keys = [torch.randn(B, nkv, T, D, generator=generator, device=device) for _ in range(steps)]
        values = [torch.randn(B, nkv, T, D, generator=generator, device=device) for _ in range(steps)]
        grad_out = torch.randn(B, nh, T, D, generator=generator, device=device)
        tensors = [query, *keys, *values]
        reference = attention_outputs(ttt_attention, tensors, grad_out, steps, torch.float32)
        for name, attention in (("eager", ttt_attention), ("sdpa", ttt_attention_sdpa)):
            got = attention_outputs(attention, tensors, grad_out, steps, torch.bfloat16)
            result[f"steps{steps}_{name}_bf16_vs_fp32"] = {
                "out": relative_error(got[0], reference[0]),
                "grads_max": max(relative_error(g, r) for g, r in zip(got[1:], reference[1:], strict=True)),
            }
    return result


def soft_cross_entropy_parity(device: torch.device) -> dict:
    """The fused path's soft cross-entropy kernel (compiled on CUDA; its gradient in forward, the step weight folded
    into the row weights) against autograd through the eager one, bf16 logits."""
    B, R, V = (4, 2000, 32000) if device.type == "cuda" else (2, 50, 512)
    generator = torch.Generator(device).manual_seed(0)
    logits = (3 * torch.randn(B, R, V, generator=generator, device=device)).to(torch.bfloat16)
    teacher_p = (4 * torch.randn(B, R, V, generator=generator, device=device)).softmax(-1)
    learnable = torch.rand(B, R, generator=generator, device=device) < 0.9
    z = logits.clone().requires_grad_()
    total, argmax = soft_cross_entropy(z, teacher_p, learnable)
    (grad,) = torch.autograd.grad(0.8 * total, z)
    fused_total, fused_grad, fused_argmax = soft_cross_entropy_kernel(logits)(
        logits, teacher_p, 0.8 * learnable.float()
    )
    return {
        "loss": relative_error(fused_total / 0.8, total),
        "argmax_equal": bool(torch.equal(fused_argmax, argmax)),
        "grad": relative_error(fused_grad, grad),
    }


def loss_agreement(drafter, target_head, batch, variants: list[str]) -> dict:
    """Each variant's loss, per-step losses and accuracies and gradient against eager's (bf16 autocast) on the same
    weights and batch; the gradients also against eager in fp32, whose distance from eager bf16 is the noise floor."""
    params = [p for p in drafter.parameters() if p.requires_grad]

    def evaluate(name: str, autocast: bool = True) -> tuple:
        loss_implementation = set_variant(drafter, name)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
            out = ttt_loss(drafter, target_head, batch, ttt_length=TTT_LENGTH, loss_implementation=loss_implementation)
        grads = torch.autograd.grad(out.loss, params)
        return out, torch.cat([g.float().flatten() for g in grads])

    reference, reference_grad = evaluate("eager")
    _, fp32_grad = evaluate("eager", autocast=False)
    result = {
        "eager": {
            "loss": float(reference.loss),
            "step_losses": reference.step_losses,
            "step_accuracies": reference.step_accuracies,
            "grad_rel_diff_vs_fp32": relative_error(reference_grad, fp32_grad),
        },
    }
    for name in variants:
        out, grad = evaluate(name)
        result[name] = {
            "loss": float(out.loss),
            "loss_rel_diff": abs(float(out.loss) - float(reference.loss)) / abs(float(reference.loss)),
            "step_loss_max_rel_diff": max(
                abs(a - b) / abs(b) for a, b in zip(out.step_losses, reference.step_losses, strict=True)
            ),
            "step_accuracy_max_abs_diff": max(
                abs(a - b) for a, b in zip(out.step_accuracies, reference.step_accuracies, strict=True)
            ),
            "grad_rel_diff": relative_error(grad, reference_grad),
            "grad_rel_diff_vs_fp32": relative_error(grad, fp32_grad),
        }
    return result


def measure(drafter, target_head, name: str, B: int, T: int, *, warmup: int, steps: int) -> dict:
    loss_implementation = set_variant(drafter, name)
    optimizer, params = build_optimizer(drafter)
    batches = [random_batch(drafter.config, B, T, DEVICE, seed) for seed in (1, 2)]
    sync()
    free_cached_memory()
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(warmup + steps):
        sync()
        started = time.perf_counter()
        losses.append(train_step(drafter, target_head, batches[step % 2], optimizer, params, loss_implementation))
        sync()
        times.append(time.perf_counter() - started)
    step_s = statistics.median(times[warmup:])
    result = {
        "variant": name,
        "batch": f"{B}x{T}",
        "step_ms": round(step_s * 1000, 2),
        "tokens_per_s": round(B * T / step_s),
        "vs_specforge": round(B * T / step_s / SPECFORGE_TOKENS_PER_S.get((B, T), float("nan")), 3),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE.type == "cuda" else 0.0,
        "warmup_ms": [round(t * 1000) for t in times[:warmup]],
        "step_ms_all": [round(t * 1000, 1) for t in times[warmup:]],
        "losses_first_last": [round(losses[0], 4), round(losses[-1], 4)],
    }
    del optimizer
    free_cached_memory()
    return result


def profile_step(drafter, target_head, name: str, B: int, T: int, path: Path) -> dict:
    """One step under the profiler: its table written to `path`, its kernel time by kind returned (and written
    beside the table)."""
    loss_implementation = set_variant(drafter, name)
    optimizer, params = build_optimizer(drafter)
    batch = random_batch(drafter.config, B, T, DEVICE, 1)
    train_step(drafter, target_head, batch, optimizer, params, loss_implementation)
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if DEVICE.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True) as profiler:
        train_step(drafter, target_head, batch, optimizer, params, loss_implementation)
        sync()
    averages = profiler.key_averages()
    by_kind = kernel_categories(averages, path.with_suffix(".json"))
    for kind, kernels in top_kernels(averages).items():
        for kernel, ms, launches in kernels:
            print(f"  {kind:<28} {ms:8.2f} ms {launches:5d}x  {kernel}", flush=True)
    try:
        table = averages.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90)
    except Exception:  # older spelling
        table = averages.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
    path.write_text(table)
    # The host's operators by their inputs' shapes, by the GPU time their kernels took: which tensors the copies and
    # casts move, which the elementwise kernels touch.
    by_shape = profiler.key_averages(group_by_input_shape=True)
    path.with_name(f"{path.stem}_by_shape.txt").write_text(
        by_shape.table(sort_by="device_time_total", row_limit=40, max_name_column_width=40, max_shapes_column_width=80)
    )
    del optimizer
    free_cached_memory()
    return by_kind


KERNEL_CATEGORIES = [  # (category, substrings of kernel names), first match wins: attention kernels name cutlass types
    ("attention", ("flash", "fmha", "attention", "sdpa")),  # cuDNN's fused attention: "..._native_sdpa_sm90_..."
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_", "sm80_", "cublas")),
    ("compiled (Inductor/Triton)", ("triton_",)),
    ("optimizer", ("adam", "multi_tensor")),
    ("copy/cast", ("copy", "memcpy", "memset", "cast", "fill")),
    ("reduction", ("reduce", "softmax", "norm", "argmax")),
]


def kernel_kind(name: str) -> str:
    name = name.lower()
    return next((c for c, keys in KERNEL_CATEGORIES if any(k in name for k in keys)), "other elementwise")


def device_events(averages) -> list:
    return [e for e in averages if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]


def kernel_categories(averages, path: Path) -> dict:
    """The step's GPU kernel time by kind (matmuls, attention, compiled kernels, ...): where a faster step has to come
    from. Written beside the profiler's table."""
    totals: dict[str, float] = {}
    for event in device_events(averages):
        category = kernel_kind(event.key)
        totals[category] = totals.get(category, 0.0) + event.self_device_time_total / 1000  # us -> ms
    summary = {c: round(ms, 2) for c, ms in sorted(totals.items(), key=lambda kv: -kv[1])}
    summary["total kernel ms"] = round(sum(totals.values()), 2)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def top_kernels(averages, per_kind: int = 3) -> dict[str, list[tuple[str, float, int]]]:
    """Each kind's longest kernels (name cut to 100 characters, ms, launches): which copies, which matmuls, printed
    in the log, so that a run whose profiler tables do not come back still says what the time is."""
    by_kind: dict[str, list[tuple[str, float, int]]] = {}
    for event in sorted(device_events(averages), key=lambda e: -e.self_device_time_total):
        kernels = by_kind.setdefault(kernel_kind(event.key), [])
        if len(kernels) < per_kind:
            kernels.append((event.key[:100], round(event.self_device_time_total / 1000, 2), int(event.count)))
    return by_kind


def parse_shape(text: str) -> tuple[int, int]:
    batch, _, tokens = text.partition("x")
    return int(batch), int(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="a folder for ttt_step_profile.json and profiles")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=280, help="skip what would start after this many seconds")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--profile", nargs="*", default=["fast+compile"], choices=list(VARIANTS))
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=parse_shape,
        default=SHAPES,
        help="BxT each, e.g. 4x2048 1x8192; the profiler traces one step at each",
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script, no timings")
    args = parser.parse_args()
    global DEVICE
    shapes = args.shapes
    if args.smoke:
        DEVICE, shapes = torch.device("cpu"), [(1, 96), (2, 96)]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    device = DEVICE
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "ttt_length": TTT_LENGTH,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "results": [],
        "errors": {},
        "phase_s": {},
    }

    def save() -> None:
        (args.out / "ttt_step_profile.json").write_text(json.dumps(report, indent=2) + "\n")

    def phase(name: str, function, *a, **kw):
        if time.perf_counter() - started > args.budget_s:
            report["errors"][name] = "skipped: over the time budget"
            save()
            return None
        t0 = time.perf_counter()
        try:
            value = function(*a, **kw)
        except Exception:
            report["errors"][name] = traceback.format_exc()[-3000:]
            print(f"{name}: FAILED\n{report['errors'][name]}", flush=True)
            value = None
            free_cached_memory()
        report["phase_s"][name] = round(time.perf_counter() - t0, 1)
        print(f"[{time.perf_counter() - started:6.1f} s] {name} ({report['phase_s'][name]} s)", flush=True)
        save()
        return value

    report["attention_parity"] = phase("attention_parity", attention_parity, device)
    report["soft_cross_entropy_parity"] = phase("soft_cross_entropy_parity", soft_cross_entropy_parity, device)
    if report["soft_cross_entropy_parity"] is None:
        loss_module.SOFT_CROSS_ENTROPY_ON_CUDA = "eager"  # the kernel failed: measure the fused path as written
        report["soft_cross_entropy_uncompiled_fallback"] = True
        report["soft_cross_entropy_parity"] = phase(
            "soft_cross_entropy_parity uncompiled", soft_cross_entropy_parity, device
        )
    models = phase("build", build_models, device)
    if models is None:
        return
    drafter, target_head = models
    variants = [name for name in args.variants if name != "eager"]
    agreement_batch = random_batch(drafter.config, 1, shapes[0][1], device, seed=7)
    report["loss_agreement"] = phase("loss_agreement", loss_agreement, drafter, target_head, agreement_batch, variants)
    for name in args.variants:
        for B, T in shapes:
            result = phase(
                f"measure {name} {B}x{T}",
                measure,
                drafter,
                target_head,
                name,
                B,
                T,
                warmup=args.warmup,
                steps=args.steps,
            )
            if result:
                report["results"].append(result)
                save()
    for name in args.profile:
        for B, T in shapes:
            # "fast+compile" spelled "fast-compile": the device brings back no file with a "+" in its name.
            path = args.out / f"profile_{name.replace('+', '-')}_{B}x{T}.txt"
            by_kind = phase(f"profile {name} {B}x{T}", profile_step, drafter, target_head, name, B, T, path)
            if by_kind:
                print(f"{name} {B}x{T} kernel ms by kind: {json.dumps(by_kind)}", flush=True)
    report["total_s"] = round(time.perf_counter() - started, 1)
    save()
    print(json.dumps(report.get("attention_parity"), indent=1))
    print(json.dumps(report.get("soft_cross_entropy_parity"), indent=1))
    print(json.dumps(report.get("loss_agreement"), indent=1))
    print(f"{'variant':24s} {'batch':7s} {'step ms':>9s} {'tokens/s':>9s} {'x SpecForge':>11s} {'peak GiB':>9s}")
    for r in report["results"]:
        print(
            f"{r['variant']:24s} {r['batch']:7s} {r['step_ms']:9.1f} {r['tokens_per_s']:9d} "
            f"{r['vs_specforge']:11.3f} {r['peak_gib']:9.2f}"
        )
    for name, error in report["errors"].items():
        print(f"ERROR {name}: {error.splitlines()[-1] if error else ''}")


if __name__ == "__main__":
    main()

"""The trainer's TTT attention with each kernel for step 0's causal block, side by side, in one command.

The fast TTT attention (`drafter.ttt_attention_sdpa`) runs step 0's causal block on a fused kernel and merges the
diagonal terms of the later steps through its logsumexp; `drafter.CAUSAL_BLOCK_KERNEL` chooses the kernel on CUDA
(`drafter.CAUSAL_BLOCK_KERNELS`: cuDNN's fused attention, the default, or FlashAttention-2). Per sequence length, at
Llama-3.1-8B's attention dims (32 query heads, 8 key-value heads, head dim 128) in bf16, one sequence, the attention of
unrolled step --steps - 1: forward and backward of each kernel, the median of --repeats after a warm-up, and how far
each kernel's output and input gradients lie from the first kernel's (relative norm of the difference, the largest
over the tensors). No fp32 reference at these lengths (its scores alone would be 32 GiB at 16K); the benchmark of the
whole step (`bench/vs_specforge.py`) checks each kernel against the eager attention in fp32 at 1,024 tokens.

    python -m bench.attention_kernels --lengths 8192 16384 32768 --steps 3 --repeats 5 [--json OUT]

On a CPU both kernels are the CPU's flash kernel (the switch is for CUDA); the script runs there so that it is tested.
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from services.trainer import drafter as drafter_module

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B


def attention_pass(
    inputs: list[torch.Tensor],
    grad_out: torch.Tensor,
    steps: int,
    *,
    kernel: str | None = None,
    attention: Callable = drafter_module.ttt_attention_sdpa,
) -> list[torch.Tensor]:
    """The output and every input's gradient of one TTT attention call on (query, keys..., values...): the fast one
    with `kernel` for step 0's block (None: the default), or `attention` (the eager `drafter.ttt_attention`)."""
    default = drafter_module.CAUSAL_BLOCK_KERNEL
    drafter_module.CAUSAL_BLOCK_KERNEL = kernel or default
    try:
        query, *steps_kv = [x.detach().requires_grad_() for x in inputs]
        out = attention(query, steps_kv[:steps], steps_kv[steps:], None, query.shape[-1] ** -0.5)
        return [out.detach(), *torch.autograd.grad(out, [query, *steps_kv], grad_out)]
    finally:
        drafter_module.CAUSAL_BLOCK_KERNEL = default


def measure(length: int, *, steps: int, repeats: int, device: torch.device, dtype: torch.dtype) -> dict:
    generator = torch.Generator(device).manual_seed(0)

    def randn(heads: int) -> torch.Tensor:
        return torch.randn(1, heads, length, HEAD_DIM, generator=generator, device=device).to(dtype)

    inputs = [randn(HEADS), *(randn(KV_HEADS) for _ in range(2 * steps))]
    grad_out = randn(HEADS)
    results: dict[str, dict] = {}
    outputs: dict[str, list[torch.Tensor]] = {}
    for kernel in drafter_module.CAUSAL_BLOCK_KERNELS:
        outputs[kernel] = attention_pass(inputs, grad_out, steps, kernel=kernel)  # the warm-up
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            attention_pass(inputs, grad_out, steps, kernel=kernel)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        results[kernel] = {
            "ran": drafter_module.causal_block_kernel(inputs[0], kernel),  # where the device lacks it, not `kernel`
            "forward_backward_ms": statistics.median(times) * 1e3,
            "runs_ms": [t * 1e3 for t in times],
        }
    first, *others = drafter_module.CAUSAL_BLOCK_KERNELS
    for kernel in others:
        results[kernel]["relative_difference_from_" + first] = max(
            float((a.float() - b.float()).norm() / b.float().norm())
            for a, b in zip(outputs[kernel], outputs[first], strict=True)
        )
        results[kernel]["time_ratio_to_" + first] = (
            results[kernel]["forward_backward_ms"] / results[first]["forward_backward_ms"]
        )
    return {"length": length, "kernels": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--steps", type=int, default=3, help="the unrolled step's keys and values: step 0's and later")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    rows = [
        measure(length, steps=args.steps, repeats=args.repeats, device=device, dtype=torch.bfloat16)
        for length in args.lengths
    ]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    first, *others = drafter_module.CAUSAL_BLOCK_KERNELS
    table = Table(title=f"TTT attention, step {args.steps - 1}, fwd+bwd, bf16, {name} (median of {args.repeats})")
    table.add_column("tokens", justify="right")
    for kernel in drafter_module.CAUSAL_BLOCK_KERNELS:
        ran_as = rows[0]["kernels"][kernel]["ran"]  # the same at every length: the device decides
        table.add_column(f"{kernel} ms" if ran_as == kernel else f"{kernel} ms ({ran_as} ran)", justify="right")
    for kernel in others:
        table.add_column(f"{kernel} / {first}", justify="right")
        table.add_column(f"{kernel} vs {first}, rel. diff.", justify="right")
    for row in rows:
        kernels = row["kernels"]
        cells = [f"{kernels[k]['forward_backward_ms']:.1f}" for k in drafter_module.CAUSAL_BLOCK_KERNELS]
        for kernel in others:
            cells.append(f"{kernels[kernel]['time_ratio_to_' + first]:.2f}x")
            cells.append(f"{kernels[kernel]['relative_difference_from_' + first]:.1e}")
        table.add_row(f"{row['length']:,}", *cells)
    Console(width=120).print(table)
    if args.json:
        args.json.write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()

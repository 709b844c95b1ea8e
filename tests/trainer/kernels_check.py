"""The trainer's Triton kernels (services/trainer/kernels.py) against the functions they stand for, as written: the
TTT attention's merges and the soft cross-entropy. Run by tests/trainer/test_kernels.py in Triton's interpreter
(TRITON_INTERPRET=1, the Triton that `make install` puts in .venv/triton-cpu): a process of its own, since Triton is
imported apart from the test environment.

    TRITON_INTERPRET=1 PYTHONPATH=.venv/triton-cpu python -m tests.trainer.kernels_check
"""

import math

import pytest
import torch

from services.trainer import drafter as drafter_module
from services.trainer import kernels
from services.trainer import loss as loss_module
from services.trainer.drafter import ttt_attention, ttt_attention_sdpa
from tests.trainer.test_drafter import ttt_attention_outputs_and_grads

# (batch, query heads, key-value heads, rows, head dim, later steps): grouped heads of 4 and of 3 (SmolLM2's), rows
# that are not a multiple of the kernels' block, a head dim below the block's width and a wide one
SHAPES = [(2, 8, 2, 37, 16, 1), (1, 9, 3, 45, 64, 3), (2, 4, 1, 33, 24, 6)]


def merge_inputs(B: int, nh: int, nkv: int, T: int, D: int, steps: int, dtype: torch.dtype) -> dict:
    """Random inputs laid out as the trainer's: the query and step 0's output a (B, T, nh, D) buffer seen as
    (B, nh, T, D), the later keys and values stacked (B, nkv, T, i, D), lse0 fp32."""
    generator = torch.Generator().manual_seed(B * 1000 + T + steps)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    return {
        "query": randn(B, T, nh, D).transpose(1, 2),
        "later_keys": randn(B, nkv, T, steps, D),
        "later_values": randn(B, nkv, T, steps, D),
        "out0": randn(B, T, nh, D).transpose(1, 2),
        "lse0": torch.randn(B, nh, T, generator=generator) + 2.0,
        "grad_out": randn(B, nh, T, D),
        "grad_query0": randn(B, T, nh, D).transpose(1, 2),
    }


def compare(got: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> None:
    relative_error = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
    assert got.shape == expected.shape and relative_error <= rtol, (what, got.shape, expected.shape, relative_error)


def check_merges(dtype: torch.dtype, rtol: float) -> None:
    for B, nh, nkv, T, D, steps in SHAPES:
        x = merge_inputs(B, nh, nkv, T, D, steps, dtype)
        scale = 1 / math.sqrt(D)
        forward_inputs = (x["query"], x["later_keys"], x["later_values"], x["out0"], x["lse0"], scale)
        expected = drafter_module.diagonal_merge_forward(*forward_inputs)
        got = kernels.diagonal_merge_forward(*forward_inputs)
        for name, g, e in zip(("out", "lse"), got, expected, strict=True):
            compare(g, e, rtol, f"forward {name} {dtype} {(B, nh, nkv, T, D, steps)}")
        assert got[0].stride() == x["query"].stride()  # laid out as the query, as the layer reads it next
        out, lse = expected
        backward_inputs = (x["grad_out"], x["grad_query0"], x["query"], out, lse, x["later_keys"], x["later_values"])
        expected = drafter_module.diagonal_merge_backward(*backward_inputs, scale)
        got = kernels.diagonal_merge_backward(*backward_inputs, scale)
        for name, g, e in zip(("query", "keys", "values"), got, expected, strict=True):
            compare(g, e, rtol, f"backward {name} {dtype} {(B, nh, nkv, T, D, steps)}")


def check_attention_through_the_kernels() -> None:
    """The whole fast TTT attention (flash block, merges, custom backward) with the Triton merges, against the eager
    reference: outputs and every gradient."""
    with pytest.MonkeyPatch.context() as patch:
        calls: list[int] = []

        def triton_merges(x: torch.Tensor) -> tuple:
            calls.append(1)
            return kernels.diagonal_merge_forward, kernels.diagonal_merge_backward

        patch.setattr(drafter_module, "_merges", triton_merges)
        for steps in (2, 5):
            eager = ttt_attention_outputs_and_grads(ttt_attention, steps, dtype=torch.float32, device="cpu")
            fast = ttt_attention_outputs_and_grads(ttt_attention_sdpa, steps, dtype=torch.float32, device="cpu")
            for reference, got in zip(eager, fast, strict=True):
                torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
        assert len(calls) == 4  # forward and backward took the Triton merges at each step count


def check_soft_cross_entropy(logits_dtype: torch.dtype) -> None:
    """Loss, gradient and argmax on random logits, the teacher a view of a longer sequence's distribution (as a step
    reads it), some rows weighted 0; a vocabulary that is not a multiple of the kernel's block, and one below it."""
    for V in (700, 5000):
        generator = torch.Generator().manual_seed(V)
        B, R, T = 3, 20, 26
        logits = (3 * torch.randn(B, R, V, generator=generator)).to(logits_dtype)
        # rows that do not sum to 1 too (the gradient's sum(p) term), as a teacher with masked rows has
        mass = torch.rand(B, T, 1, generator=generator)
        teacher_p = ((4 * torch.randn(B, T, V, generator=generator)).softmax(-1) * mass)[:, 2 : 2 + R]
        weight = 0.8 * (torch.rand(B, R, generator=generator) < 0.7).float()
        expected = loss_module.soft_cross_entropy_with_grad(logits, teacher_p, weight)
        got = kernels.soft_cross_entropy_with_grad(logits, teacher_p, weight)
        torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-4)
        # bf16: both gradients are rounded once to bf16, from fp32 values summed in different orders
        tolerance = {"rtol": 1e-5, "atol": 1e-7} if logits_dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-6}
        torch.testing.assert_close(got[1], expected[1], **tolerance)
        assert got[1].dtype == logits.dtype
        assert torch.equal(got[2], expected[2])  # bf16 logits tie: both take the first of the largest


def main() -> None:
    check_merges(torch.float32, rtol=1e-6)
    # bf16 in and out, fp32 inside on both sides: they differ by the rounding of the outputs and the order of sums
    check_merges(torch.bfloat16, rtol=1e-2)
    check_attention_through_the_kernels()
    check_soft_cross_entropy(torch.float32)
    check_soft_cross_entropy(torch.bfloat16)
    print("kernels agree")


if __name__ == "__main__":
    main()

"""The trainer's Triton kernels, each the fast form of a function written out in plain tensor ops elsewhere (the
readable reference, which the CPU runs and the tests compare against):

- `diagonal_merge_forward` / `diagonal_merge_backward`: the TTT attention's diagonal merges
  (`drafter.diagonal_merge_forward` / `_backward`), each row's work done in registers in one pass over its inputs.
- `soft_cross_entropy_with_grad`: a step's soft cross-entropy against the teacher, its gradient with respect to the
  logits and their argmax (`loss.soft_cross_entropy_with_grad`), two passes over each row's logits and teacher.

Inductor's kernels compiled from the same expressions ran 4-7x slower than the bytes they move at 8B dims (a merge's
backward 1.39 ms at 1x8192 on an H100, the soft cross-entropy 3.2 ms a step on an H200: docs/benchmarks.md): they
wrote intermediates of their own or read each row more times than needed.

The merges. Row t of unrolled step i attends step 0's causal block (a fused attention kernel gives its output out0
and logsumexp lse0) and its own keys and values of steps 1..i. For the G query heads that share a key-value head, a
program takes BLOCK_T rows, loads each later key and value row once per head and keeps the softmax's running maximum
and sum (online softmax), so nothing of size (rows x G x i) or any fp32 copy of an input is written to memory.
Backward is two kernels: the first computes the query's gradient and each (row, head, step)'s probability p and
score gradient ds (small fp32 tensors); the second sums p x dout and ds x query over the G heads of each key-value
head into the later keys' and values' gradients.

Everything is fp32 inside, bf16 or fp16 (or fp32) in and out. Imported only where Triton is: on CUDA, and on the CPU
under Triton's interpreter (TRITON_INTERPRET=1) in the tests.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

# Rows a merge program takes. 32 rows of a 128-wide head keep the four [rows, D] fp32 tiles a loop holds in registers.
BLOCK_T = 32
# Vocabulary entries the soft cross-entropy loads at once: eight [BLOCK_V] fp32 vectors in registers over 8 warps.
BLOCK_V = 2048


@triton.jit
def _row_block(T, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's BLOCK_T rows (grid axis 0) and the head dim's columns, with their in-bounds masks."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    row_in = rows < T
    return rows, cols, row_in, row_in[:, None] & (cols < D)[None, :]


@triton.jit
def _load_tile(tensor, b, head, b_stride, head_stride, row_stride, rows, cols, tile_in):
    """A [rows, head dim] tile of a (B, heads, T, D) tensor's head `head` (or of a (B, heads, T, i, D) tensor's
    step, `tensor` offset to it), fp32, 0 outside the tensor."""
    tile = tl.load(
        tensor + b * b_stride + head * head_stride + rows[:, None] * row_stride + cols[None, :], tile_in, 0.0
    )
    return tile.to(tl.float32)


@triton.jit
def _merge_forward_kernel(
    query, out0, lse0, keys, values, out, lse,
    T, scale,
    q_sb, q_sh, q_st, o0_sb, o0_sh, o0_st, o_sb, o_sh, o_st, l0_sb, l0_sh, l_sb, l_sh,
    k_sb, k_sh, k_st, k_si, v_sb, v_sh, v_st, v_si,
    G: tl.constexpr, STEPS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    rows, cols, row_in, tile_in = _row_block(T, D, BLOCK_T, BLOCK_D)
    kv_head, b = tl.program_id(1), tl.program_id(2)
    for g in tl.static_range(G):
        h = kv_head * G + g
        q = _load_tile(query, b, h, q_sb, q_sh, q_st, rows, cols, tile_in)
        acc = _load_tile(out0, b, h, o0_sb, o0_sh, o0_st, rows, cols, tile_in)
        # Online softmax over [step 0's block, the later steps' own keys]: m the running maximum, s the running sum
        # of exp(score - m); step 0's block enters as the single score lse0 with output out0.
        m = tl.load(lse0 + b * l0_sb + h * l0_sh + rows, row_in, other=0.0)
        s = tl.full([BLOCK_T], 1.0, tl.float32)
        for j in tl.static_range(STEPS):
            k = _load_tile(keys + j * k_si, b, kv_head, k_sb, k_sh, k_st, rows, cols, tile_in)
            score = tl.sum(q * k, axis=1) * scale
            m_next = tl.maximum(m, score)
            rescale, p = tl.exp(m - m_next), tl.exp(score - m_next)
            v = _load_tile(values + j * v_si, b, kv_head, v_sb, v_sh, v_st, rows, cols, tile_in)
            acc = acc * rescale[:, None] + p[:, None] * v
            s = s * rescale + p
            m = m_next
        o = acc / s[:, None]
        tl.store(out + b * o_sb + h * o_sh + rows[:, None] * o_st + cols[None, :], o.to(out.dtype.element_ty), tile_in)
        tl.store(lse + b * l_sb + h * l_sh + rows, m + tl.log(s), row_in)


@triton.jit
def _merge_backward_query_kernel(
    grad_out, grad_query0, query, out, lse, keys, values, grad_query, probs, grad_scores,
    T, NKV, scale,
    go_sb, go_sh, go_st, gq0_sb, gq0_sh, gq0_st, q_sb, q_sh, q_st, o_sb, o_sh, o_st, l_sb, l_sh,
    k_sb, k_sh, k_st, k_si, v_sb, v_sh, v_st, v_si, gq_sb, gq_sh, gq_st,
    G: tl.constexpr, STEPS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    rows, cols, row_in, tile_in = _row_block(T, D, BLOCK_T, BLOCK_D)
    kv_head, b = tl.program_id(1), tl.program_id(2)
    for g in tl.static_range(G):
        h = kv_head * G + g
        q = _load_tile(query, b, h, q_sb, q_sh, q_st, rows, cols, tile_in)
        dout = _load_tile(grad_out, b, h, go_sb, go_sh, go_st, rows, cols, tile_in)
        o = _load_tile(out, b, h, o_sb, o_sh, o_st, rows, cols, tile_in)
        delta = tl.sum(dout * o, axis=1)  # rowsum(dout * out)
        row_lse = tl.load(lse + b * l_sb + h * l_sh + rows, row_in, other=0.0)
        acc = _load_tile(grad_query0, b, h, gq0_sb, gq0_sh, gq0_st, rows, cols, tile_in)
        for j in tl.static_range(STEPS):
            k = _load_tile(keys + j * k_si, b, kv_head, k_sb, k_sh, k_st, rows, cols, tile_in)
            v = _load_tile(values + j * v_si, b, kv_head, v_sb, v_sh, v_st, rows, cols, tile_in)
            p = tl.exp(tl.sum(q * k, axis=1) * scale - row_lse)
            ds = p * (tl.sum(dout * v, axis=1) - delta)
            acc += ds[:, None] * k * scale
            # (B, nkv, G, STEPS, T): each (row, head, step)'s p and ds, contiguous over rows
            at = (((b * NKV + kv_head) * G + g) * STEPS + j) * T + rows
            tl.store(probs + at, p, row_in)
            tl.store(grad_scores + at, ds, row_in)
        gq = acc.to(grad_query.dtype.element_ty)
        tl.store(grad_query + b * gq_sb + h * gq_sh + rows[:, None] * gq_st + cols[None, :], gq, tile_in)


@triton.jit
def _merge_backward_keys_kernel(
    grad_out, query, probs, grad_scores, grad_keys, grad_values,
    T, NKV, scale,
    go_sb, go_sh, go_st, q_sb, q_sh, q_st,
    gk_sb, gk_sh, gk_st, gk_si, gv_sb, gv_sh, gv_st, gv_si,
    G: tl.constexpr, STEPS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    rows, cols, row_in, tile_in = _row_block(T, D, BLOCK_T, BLOCK_D)
    kv_head, b = tl.program_id(1), tl.program_id(2)
    for j in tl.static_range(STEPS):
        grad_k = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        grad_v = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        for g in tl.static_range(G):
            h = kv_head * G + g
            at = (((b * NKV + kv_head) * G + g) * STEPS + j) * T + rows
            p = tl.load(probs + at, row_in, other=0.0)
            ds = tl.load(grad_scores + at, row_in, other=0.0)
            q = _load_tile(query, b, h, q_sb, q_sh, q_st, rows, cols, tile_in)
            dout = _load_tile(grad_out, b, h, go_sb, go_sh, go_st, rows, cols, tile_in)
            grad_k += ds[:, None] * q
            grad_v += p[:, None] * dout
        gk = (grad_k * scale).to(grad_keys.dtype.element_ty)
        tl.store(
            grad_keys + b * gk_sb + kv_head * gk_sh + rows[:, None] * gk_st + j * gk_si + cols[None, :], gk, tile_in
        )
        gv = grad_v.to(grad_values.dtype.element_ty)
        tl.store(
            grad_values + b * gv_sb + kv_head * gv_sh + rows[:, None] * gv_st + j * gv_si + cols[None, :], gv, tile_in
        )


def _grid(query: Tensor, num_kv_heads: int) -> tuple[int, int, int]:
    B, _, T, _ = query.shape
    return triton.cdiv(T, BLOCK_T), num_kv_heads, B


def _check_unit_stride(*tensors: Tensor) -> None:
    for tensor in tensors:
        if tensor.stride(-1) != 1:
            raise ValueError(f"the kernels read the last dimension contiguous; got strides {tensor.stride()}")


def diagonal_merge_forward(
    query: Tensor, later_keys: Tensor, later_values: Tensor, out0: Tensor, lse0: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """As `drafter.diagonal_merge_forward`: query, out0 (B, nh, T, D); later_keys / later_values (B, nkv, T, i, D);
    lse0 fp32 (B, nh, T). Returns out (B, nh, T, D, laid out as the query) and the merged lse fp32 (B, nh, T)."""
    B, nh, T, D = query.shape
    nkv, steps = later_keys.shape[1], later_keys.shape[3]
    _check_unit_stride(query, later_keys, later_values, out0)
    out = torch.empty_like(query)
    lse = torch.empty(B, nh, T, device=query.device, dtype=torch.float32)
    lse0 = lse0.contiguous()
    _merge_forward_kernel[_grid(query, nkv)](
        query, out0, lse0, later_keys, later_values, out, lse,
        T, scale,
        *query.stride()[:3], *out0.stride()[:3], *out.stride()[:3], *lse0.stride()[:2], *lse.stride()[:2],
        *later_keys.stride()[:4], *later_values.stride()[:4],
        G=nh // nkv, STEPS=steps, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_T=BLOCK_T,
    )  # fmt: skip
    return out, lse


def diagonal_merge_backward(
    grad_out: Tensor,
    grad_query0: Tensor,
    query: Tensor,
    out: Tensor,
    lse: Tensor,
    later_keys: Tensor,
    later_values: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """As `drafter.diagonal_merge_backward`: the query's whole gradient (B, nh, T, D, laid out as the query) and those
    of the later keys and values (B, nkv, T, i, D), in the query's dtype."""
    B, nh, T, D = query.shape
    nkv, steps = later_keys.shape[1], later_keys.shape[3]
    G = nh // nkv
    _check_unit_stride(grad_out, grad_query0, query, out, later_keys, later_values)
    lse = lse.contiguous()
    grad_query = torch.empty_like(query)
    probs = torch.empty(B, nkv, G, steps, T, device=query.device, dtype=torch.float32)
    grad_scores = torch.empty_like(probs)
    grad_keys = torch.empty(later_keys.shape, device=query.device, dtype=query.dtype)
    grad_values = torch.empty(later_values.shape, device=query.device, dtype=query.dtype)
    constants = {"G": G, "STEPS": steps, "D": D, "BLOCK_D": triton.next_power_of_2(D), "BLOCK_T": BLOCK_T}
    _merge_backward_query_kernel[_grid(query, nkv)](
        grad_out, grad_query0, query, out, lse, later_keys, later_values, grad_query, probs, grad_scores,
        T, nkv, scale,
        *grad_out.stride()[:3], *grad_query0.stride()[:3], *query.stride()[:3], *out.stride()[:3], *lse.stride()[:2],
        *later_keys.stride()[:4], *later_values.stride()[:4], *grad_query.stride()[:3],
        **constants,
    )  # fmt: skip
    _merge_backward_keys_kernel[_grid(query, nkv)](
        grad_out, query, probs, grad_scores, grad_keys, grad_values,
        T, nkv, scale,
        *grad_out.stride()[:3], *query.stride()[:3], *grad_keys.stride()[:4], *grad_values.stride()[:4],
        **constants,
    )  # fmt: skip
    return grad_query, grad_keys, grad_values


@triton.jit
def _soft_cross_entropy_kernel(
    logits, teacher_p, weight, grad, row_loss, argmax,
    R, V, z_sb, z_sr, p_sb, p_sr, g_sb, g_sr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    r, b = tl.program_id(0), tl.program_id(1)
    row = b * R + r  # in the (B, R) row weights, losses and argmaxes
    # 64-bit offsets: a (B, T, V) teacher holds more than 2**31 elements at 2x32768 tokens and 32,000 draft tokens
    logits += b.to(tl.int64) * z_sb + r.to(tl.int64) * z_sr
    teacher_p += b.to(tl.int64) * p_sb + r.to(tl.int64) * p_sr
    grad += b.to(tl.int64) * g_sb + r.to(tl.int64) * g_sr
    lanes = tl.arange(0, BLOCK_V)
    # Pass 1, per lane then across lanes: the running maximum and sum of exp(z - max) (online logsumexp), the first
    # index of the largest logit, sum(p) and sum(p * z). A finite floor, not -inf, so that a lane that never sees a
    # logit (V below the block) gives exp(0) * 0, not NaN.
    lane_max = tl.full([BLOCK_V], -1e30, tl.float32)
    lane_sum = tl.zeros([BLOCK_V], tl.float32)
    lane_best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_best_at = tl.zeros([BLOCK_V], tl.int32)
    lane_p = tl.zeros([BLOCK_V], tl.float32)
    lane_pz = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + lanes
        valid = cols < V
        z = tl.load(logits + cols, valid, other=float("-inf")).to(tl.float32)
        p = tl.load(teacher_p + cols, valid, other=0.0).to(tl.float32)
        next_max = tl.maximum(lane_max, z)
        lane_sum = lane_sum * tl.exp(lane_max - next_max) + tl.exp(z - next_max)
        lane_max = next_max
        better = z > lane_best  # strictly: a lane keeps its first occurrence of its largest value
        lane_best = tl.where(better, z, lane_best)
        lane_best_at = tl.where(better, cols, lane_best_at)
        lane_p += p
        lane_pz += p * tl.where(valid, z, 0.0)
    row_max = tl.max(lane_max, axis=0)
    lse = row_max + tl.log(tl.sum(lane_sum * tl.exp(lane_max - row_max), axis=0))
    best = tl.max(lane_best, axis=0)
    tl.store(argmax + row, tl.min(tl.where(lane_best == best, lane_best_at, V), axis=0).to(tl.int64))
    p_sum = tl.sum(lane_p, axis=0)
    w = tl.load(weight + row)
    # cross-entropy = -sum_v p_v (z_v - lse) = sum(p) * lse - sum(p * z)
    tl.store(row_loss + row, w * (p_sum * lse - tl.sum(lane_pz, axis=0)))
    # Pass 2: d/dz = w * (sum(p) * softmax(z) - p), in the logits' dtype.
    for start in range(0, V, BLOCK_V):
        cols = start + lanes
        valid = cols < V
        z = tl.load(logits + cols, valid, other=0.0).to(tl.float32)
        p = tl.load(teacher_p + cols, valid, other=0.0).to(tl.float32)
        g = w * (p_sum * tl.exp(z - lse) - p)
        tl.store(grad + cols, g.to(grad.dtype.element_ty), valid)


def soft_cross_entropy_with_grad(logits: Tensor, teacher_p: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """As `loss.soft_cross_entropy_with_grad`: logits (B, R, V) and the teacher's distribution (B, R, V) (a view of a
    longer sequence's, read in place), row weights (B, R). Returns sum(weight * cross_entropy) fp32, its gradient with
    respect to the logits in their dtype, and their argmax (B, R)."""
    B, R, V = logits.shape
    _check_unit_stride(logits, teacher_p)
    w = weight.float().contiguous()
    grad = torch.empty(B, R, V, device=logits.device, dtype=logits.dtype)
    row_loss = torch.empty(B, R, device=logits.device, dtype=torch.float32)
    argmax = torch.empty(B, R, device=logits.device, dtype=torch.long)
    if B * R:
        _soft_cross_entropy_kernel[(R, B)](
            logits, teacher_p, w, grad, row_loss, argmax,
            R, V, *logits.stride()[:2], *teacher_p.stride()[:2], *grad.stride()[:2],
            BLOCK_V=min(BLOCK_V, triton.next_power_of_2(V)), num_warps=8,
        )  # fmt: skip
    return row_loss.sum(), grad, argmax

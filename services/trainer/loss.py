"""The whole EAGLE-3 training objective: the training-time test (TTT), step by step.

What the drafter learns. The target read tokens x_0..x_{T-1}; at position t it left three aux states and its final
(post-norm) state, whose lm_head distribution is its guess for x_{t+1}. In decoding, the drafter sits one token
behind the target: it holds the target's features for position t *and* the token x_{t+1} the target already chose
from them, and guesses x_{t+2}; then it keeps going on its own, feeding back its own hidden state. The TTT trains
exactly that chain on stored data:

    row t, step 0:  hidden = fc(aux[t]),               token x_{t+1}, RoPE position t     -> predicts x_{t+2}
    row t, step i:  hidden = drafter output of step i-1, token x_{t+1+i}, position t + i    -> predicts x_{t+2+i}

The teacher for row t at step i is the target's distribution at position t+1+i, restricted to the draft vocabulary
and renormalised (soft cross-entropy, EAGLE-3's "forward KL" up to the constant target entropy). Attention follows
EAGLE-3's TTT mask: step i at row t sees step 0's causal prefix (real target features) and its own rows of steps
1..i (see `drafter.ttt_attention`), which is what the drafter's KV cache holds when it drafts i tokens ahead.

Which rows count. `loss_mask[k] == 1` marks the tokens the drafter must learn to predict (assistant content and its
end-of-turn, `shared/data/tokenization.py`), so row t at step i counts iff the token it predicts, x_{t+2+i}, is inside
the sequence, not padding, and in the loss mask. SpecForge instead shifts the mask with the input ids
(`loss_mask[t+i]`); we gate on the predicted token because that is what our mask means. Following EAGLE-3, a row
whose target greedy token is outside the draft vocabulary adds nothing to the loss (the drafter can never propose
it) but still counts as a miss for accuracy, as it would in decoding.

Normalisation. Each step's loss is a mean over that step's counted rows; the total is sum_i step_decay**i * loss_i
(EAGLE-3's 0.8**i). Accuracy at step i = (drafter argmax, mapped to a target id) == (target argmax), over counted rows.

Two implementations of the per-step lm_head and soft cross-entropy, by name (`LOSS_IMPLEMENTATIONS`): "eager" is
the readable reference (the logits, then an fp32 log-softmax over [B, T, V_draft] that autograd keeps for backward);
"fused", the default, computes the loss, its gradient and the argmax in one pass over the logits
(`soft_cross_entropy_with_grad`, compiled on CUDA) and takes lm_head's two gradients in forward too, a block of rows
at a time (`_HeadSoftCrossEntropy`), so that backward keeps neither logits nor their gradient, only the gradient of
the head's input and one sum of the weight's gradient over the steps; and it computes the teacher, the logits and the
loss only for the rows that predict a counted token (gathered by the token they predict, the same rows at every step),
so prompts and padding cost no vocabulary projection. Both give the same values; without gradients (evaluation) both
compute the reference.

Checked against (read, not copied): sgl-project/SpecForge@a6b6b02 specforge/algorithms/eagle3/model.py (Steps 1-5.7:
targets from the stored final state, position mask = t2d[target argmax] * loss mask, shift left per step, accuracy
via d2t), specforge/modeling/target/target_head.py (`preprocess`: input ids and target shifted left once, EAGLE's
offset), specforge/core/loss.py (soft cross-entropy), specforge/training/strategies/base.py (weights 0.8**i);
SafeAILab/EAGLE eagle/traineagle3/cnets.py.
"""

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from services.trainer.drafter import Eagle3Drafter, TargetHead, TTTCache, autocast_input


@dataclass
class Batch:
    input_ids: Tensor  # long [B, T]
    loss_mask: Tensor  # long [B, T], 1 on tokens the drafter must learn to predict
    aux_hidden_state: Tensor  # [B, T, 3H_t], three target layers concatenated, low to high
    hidden_state: Tensor  # [B, T, H_t], the target's post-final-norm state (input to its lm_head)
    attention_mask: Tensor  # bool [B, T], False on right padding
    # [B, T, H] the drafter's (frozen) token embeddings of input_ids, looked up by the trainer's loader on the host
    # (`with_token_embeds`) so that the embedding table never takes GPU memory; None: the drafter looks them up
    token_embeds: Tensor | None = None

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> "Batch":
        """On `device`; `non_blocking` from page-locked memory: the host goes on launching kernels while it copies."""
        return Batch(
            input_ids=self.input_ids.to(device, non_blocking=non_blocking),
            loss_mask=self.loss_mask.to(device, non_blocking=non_blocking),
            aux_hidden_state=self.aux_hidden_state.to(device, non_blocking=non_blocking),
            hidden_state=self.hidden_state.to(device, non_blocking=non_blocking),
            attention_mask=self.attention_mask.to(device, non_blocking=non_blocking),
            token_embeds=None if self.token_embeds is None else self.token_embeds.to(device, non_blocking=non_blocking),
        )


def with_token_embeds(batch: Batch, embedding: Tensor) -> Batch:
    """The batch with its tokens' embeddings looked up in `embedding` [V_target, H] (a table on the host: a gather of
    H values a token, done by the loader's threads while the step before runs), into page-locked memory where the
    batch is."""
    ids = batch.input_ids.to(embedding.device).flatten()
    pinned = embedding.device.type == "cpu" and batch.input_ids.is_pinned()
    embeds = torch.empty((ids.numel(), embedding.shape[1]), dtype=embedding.dtype, pin_memory=pinned)
    torch.index_select(embedding, 0, ids, out=embeds)
    return replace(batch, token_embeds=embeds.view(*batch.input_ids.shape, embedding.shape[1]))


@dataclass
class TTTOutput:
    loss: Tensor  # scalar, sum_i step_decay**i * step_loss_i, the value to backpropagate
    step_losses: list[float]  # per unrolled step, mean over that step's counted rows
    step_accuracies: list[float]  # per unrolled step; 0.0 where a step has no counted rows
    num_loss_tokens: int  # counted rows at step 0
    step_num_tokens: list[int]  # counted rows per step (fewer later: the sequence ends sooner), for weighted means


# ----------------------------------------------------------------------------------------------------------
# The per-step soft cross-entropy: logits [B, R, V_draft] against the teacher's distribution [B, R, V_draft],
# summed over the rows where `learnable` [B, R] is set. Each returns (that sum, the drafter's argmax [B, R]).


def soft_cross_entropy(logits: Tensor, teacher_p: Tensor, learnable: Tensor) -> tuple[Tensor, Tensor]:
    """The eager reference; under autocast the logits come out bf16, the loss is fp32."""
    cross_entropy = -(teacher_p * logits.float().log_softmax(-1)).sum(-1)  # (B, R)
    return (cross_entropy * learnable).sum(), logits.argmax(-1)


def soft_cross_entropy_with_grad(logits: Tensor, teacher_p: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The fused path's kernel, in plain tensor ops: sum(weight * cross_entropy), its gradient with respect to the
    logits (in their dtype), and their argmax. d/dz of -sum_v p_v log_softmax(z)_v is sum(p) * softmax(z) - p."""
    z = logits.float()  # (B, R, V_draft)
    log_probs = z - z.logsumexp(-1, keepdim=True)  # (B, R, V_draft)
    cross_entropy = -(teacher_p * log_probs).sum(-1)  # (B, R)
    grad = weight[..., None] * (teacher_p.sum(-1, keepdim=True) * log_probs.exp() - teacher_p)  # (B, R, V_draft)
    return (cross_entropy * weight).sum(), grad.to(logits.dtype), logits.argmax(-1)


# Which kernel computes it on CUDA: "triton" (services/trainer/kernels.py: two passes over each row's logits and
# teacher, the logsumexp online; 0.95-0.96x the step of "compiled" with every position learned at 4x2048 and 1x8192 on
# an H100, docs/benchmarks.md), "compiled" (Inductor's fused reduction from the expressions above, which reads each
# row several times: 3.2 ms a step at 1x8192 on an H200; `bench/vs_specforge.py`'s variant `compiled_cross_entropy`)
# or "eager" (as written). Elsewhere (tests, fp32 CPU runs) it runs as written.
SOFT_CROSS_ENTROPY_ON_CUDA = "triton"
SOFT_CROSS_ENTROPY_KERNELS = ("triton", "compiled", "eager")


@functools.cache
def _compiled_soft_cross_entropy_with_grad() -> Callable:
    return torch.compile(soft_cross_entropy_with_grad, dynamic=True)  # dynamic: rows shrink every step, batches vary


LOSS_IMPLEMENTATIONS = ("eager", "fused")

# Rows of logits computed at once by the teacher and by the fused head: 2**28 elements, 512 MiB of bf16 logits.
HEAD_CHUNK_ELEMENTS = 2**28

# On CUDA, bf16 (or fp16) matmuls whose product is summed into an fp32 tensor by cuBLAS itself (`out_dtype`); False
# sums as written, a low-precision product added to the fp32 total.
SUM_IN_FP32_ON_CUDA = True


def matmul_sums_in_fp32(a: Tensor, b: Tensor) -> bool:
    """Whether `a @ b` can be summed into an fp32 tensor by the matmul itself: low-precision CUDA inputs, where this
    torch's cuBLAS path takes an fp32 output (`_fp32_sums_work`)."""
    low_precision = a.dtype in (torch.bfloat16, torch.float16) and a.dtype == b.dtype
    return SUM_IN_FP32_ON_CUDA and a.is_cuda and low_precision and _fp32_sums_work(a.device, a.dtype)


@functools.cache
def _fp32_sums_work(device: torch.device, dtype: torch.dtype) -> bool:
    """Tried once per device and dtype on small matrices, into the total itself as the head uses it: torch builds
    without the fp32-output matmul (or a cuBLAS that refuses it) keep the written-out sum."""
    a = torch.arange(12, device=device, dtype=torch.float32).view(3, 4).div(7)
    b = torch.arange(20, device=device, dtype=torch.float32).view(4, 5).div(11)
    with torch.autocast(device.type, enabled=False):  # the head asks from under autocast
        try:
            total = torch.mm(a.to(dtype), b.to(dtype), out_dtype=torch.float32)
            torch.addmm(total, a.to(dtype), b.to(dtype), out_dtype=torch.float32, out=total)
        except (RuntimeError, TypeError, NotImplementedError):
            return False
        expected = 2 * (a.to(dtype).float() @ b.to(dtype).float())
    return total.dtype == torch.float32 and bool(torch.allclose(total, expected, rtol=1e-5, atol=1e-5))


class HeadGradient:
    """The drafter lm_head weight's gradient of one TTT loss, summed over its unrolled steps as their forwards compute
    it (fp32, V_draft x H), and handed to autograd once, by the first of the steps' backwards to run."""

    def __init__(self) -> None:
        self.total: Tensor | None = None
        self.factor: Tensor | None = None  # the loss's factor from the first backward (1, or the caller's scale)

    def add(self, grad_logits: Tensor, hidden: Tensor) -> None:
        """total += grad_logits^T @ hidden, (V_draft, n) x (n, H). On CUDA the matmul sums into the fp32 total itself
        (`matmul_sums_in_fp32`): no bf16 product of the head's size to write, read back and add, 0.4 ms a step at
        8B dims, and the steps' terms add up unrounded."""
        product = grad_logits.T
        if self.total is None:
            if matmul_sums_in_fp32(product, hidden):
                self.total = torch.mm(product, hidden, out_dtype=torch.float32)
            else:
                self.total = (product @ hidden).float()
        elif matmul_sums_in_fp32(product, hidden):
            torch.addmm(self.total, product, hidden, out_dtype=torch.float32, out=self.total)
        else:
            self.total += product @ hidden

    def take(self, factor: Tensor) -> Tensor | None:
        """The sum times the caller's factor on the loss, once; None after. Every step's term must enter the loss
        with the same factor (ttt_loss adds them up): checked on the GPU without a host sync."""
        if self.factor is not None:
            torch._assert_async(factor == self.factor, "the TTT steps' head terms entered the loss unequally")
            return None
        self.factor = factor
        assert self.total is not None, "a step's backward ran before any step's forward"
        # Scaled in place and handed over (autograd may keep it as the weight's .grad): no second copy of its size.
        total, self.total = self.total.mul_(factor), None
        return total


class _HeadSoftCrossEntropy(torch.autograd.Function):
    """lm_head and the step's weighted soft cross-entropy, `scale` * sum over rows, with both of the head's gradients
    taken in forward, a block of rows at a time: backward keeps the gradient of the head's input (2 x H bytes a row)
    and, once per loss, the weight's gradient summed over the steps (`HeadGradient`), instead of every step's bf16
    gradient of its logits (2 x V_draft bytes a row: 64 KB at 32,000 draft tokens, for each of 7 steps). The same
    matmuls as autograd's backward of lm_head, in forward; the step's weight in the loss (`scale`) is known there,
    and the loss is linear in the steps' terms, so only the caller's factor (1, or a loss scale) is left to backward.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        compute_weight: Tensor,
        teacher_p: Tensor,
        learnable: Tensor,
        scale: Tensor,
        head_gradient: HeadGradient,
    ) -> tuple[Tensor, Tensor]:
        # hidden (B, R, H) normed, in the compute dtype; weight (V_draft, H), the fp32 master under autocast, whose
        # gradient this returns; compute_weight the same in hidden's dtype, cast once for all the steps of a loss.
        w = compute_weight
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        argmax = torch.empty(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        for block in _row_blocks(*hidden.shape[:2], rows_at_once=HEAD_CHUNK_ELEMENTS // w.shape[0]):
            h = hidden[block]  # (b, r, H)
            logits = h @ w.T  # (b, r, V_draft)
            weight_rows = learnable[block].float() * scale  # the step's factor folded into the kernel's row weights
            block_total, grad_logits, argmax[block] = soft_cross_entropy_kernel(logits)(
                logits, teacher_p[block], weight_rows
            )
            total += block_total
            grad_hidden[block] = grad_logits @ w
            head_gradient.add(grad_logits.flatten(0, 1), h.flatten(0, 1))
        ctx.save_for_backward(grad_hidden)
        ctx.head_gradient = head_gradient
        ctx.mark_non_differentiable(argmax)
        return total, argmax

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor, _grad_argmax: Tensor | None) -> tuple[Tensor | None, ...]:
        (grad_hidden,) = ctx.saved_tensors
        grad_weight = ctx.head_gradient.take(grad_total)
        # The factor (fp32) multiplies the product, not the low-precision gradient.
        return (grad_hidden.float() * grad_total).to(grad_hidden.dtype), grad_weight, None, None, None, None, None


def _row_blocks(batch: int, rows: int, *, rows_at_once: int) -> Iterator[tuple[slice, slice]]:
    """(sequences, rows) index blocks of about `rows_at_once` rows of a (batch, rows, ...) tensor: whole sequences
    together while they fit (a batch of short sequences is a few large matmuls), else a sequence's rows in parts.
    Blocks are views of the teacher's (B, T, V) tensor, never copies."""
    rows_at_once = max(1, rows_at_once)
    if rows <= rows_at_once:
        sequences = max(1, rows_at_once // max(rows, 1))
        for b in range(0, batch, sequences):
            yield slice(b, b + sequences), slice(0, rows)
        return
    for b in range(batch):
        for start in range(0, rows, rows_at_once):
            yield slice(b, b + 1), slice(start, start + rows_at_once)


def head_soft_cross_entropy(
    drafter: Eagle3Drafter,
    hidden: Tensor,
    head_weight: Tensor,
    teacher_p: Tensor,
    learnable: Tensor,
    scale: Tensor,
    gradient: HeadGradient,
) -> tuple[Tensor, Tensor]:
    """`scale` * `soft_cross_entropy(drafter.compute_logits(hidden), ...)`, its gradients taken in forward.
    head_weight: lm_head's weight as the matmuls read it (`autocast_input` of it, detached), one copy for every step."""
    normed = autocast_input(drafter.norm(hidden))
    weight = drafter.lm_head.weight
    return _HeadSoftCrossEntropy.apply(normed, weight, head_weight, teacher_p, learnable, scale, gradient)


def soft_cross_entropy_kernel(logits: Tensor) -> Callable:
    """`soft_cross_entropy_with_grad` for `logits`: on CUDA the kernel `SOFT_CROSS_ENTROPY_ON_CUDA` names, as written
    elsewhere."""
    if logits.is_cuda and SOFT_CROSS_ENTROPY_ON_CUDA == "triton":
        from services.trainer import kernels  # Triton is there only beside a CUDA build of torch

        return kernels.soft_cross_entropy_with_grad
    if logits.is_cuda and SOFT_CROSS_ENTROPY_ON_CUDA == "compiled":
        return _compiled_soft_cross_entropy_with_grad()
    return soft_cross_entropy_with_grad


def teacher(target_head: TargetHead, hidden_rows: Tensor, draft_vocab: Tensor) -> tuple[Tensor, Tensor]:
    """The target's greedy next token (n,) and its distribution over the draft vocabulary (n, V_draft), fp32, from its
    final states (n, H_t). A few thousand rows at a time, so that the full vocabulary's logits (V_target x 2 bytes a
    row) never exist for a whole long batch. Under autocast the logits are bf16; argmax and the fp32 softmax read them
    as they are (an exact upcast), so the full vocabulary never gets an fp32 copy."""
    n = hidden_rows.shape[0]
    tokens = torch.empty(n, dtype=torch.long, device=hidden_rows.device)
    p = torch.empty(n, len(draft_vocab), dtype=torch.float32, device=hidden_rows.device)
    chunk = max(1, HEAD_CHUNK_ELEMENTS // target_head.weight.shape[0])
    for start in range(0, n, chunk):
        part = slice(start, start + chunk)
        target_logits = target_head(hidden_rows[part])  # (rows, V_target)
        tokens[part] = target_logits.argmax(-1)
        p[part] = target_logits.index_select(-1, draft_vocab).softmax(-1, dtype=torch.float32)
    return tokens, p


# A step's MLP skips the rows no counted prediction needs only where they are at least this share of its rows:
# gathering the others and adding the MLP's output back (and both in backward) cost about what the MLP costs on 6% of
# the rows at 8B dims on an H100 (docs/benchmarks.md). A batch where every token is learned leaves 2 + i rows of each
# sequence at step i, too few to be worth it.
MIN_SKIPPED_ROWS = 1 / 16


def live_rows(predictable: Tensor, ttt_length: int) -> list[Tensor | None]:
    """Per unrolled step i, the rows (flat indices into B x T) whose output a counted prediction needs: row t predicts
    token t+2+j at step j, and its state at step i feeds only its own row's later steps (the TTT mask shares step 0's
    keys and values alone, read before the MLP), so it is needed iff one of tokens t+2+i .. t+1+ttt_length counts.
    Fewer rows every step; prompts and padding need none. None for a step where fewer than `MIN_SKIPPED_ROWS` of the
    rows are not needed: every row's, then. One host sync a step, all before the steps run."""
    B, T = predictable.shape
    ahead = torch.zeros(B, T + ttt_length + 2, dtype=torch.bool, device=predictable.device)  # none past the end
    ahead[:, :T] = predictable
    needed = torch.zeros_like(ahead[:, :T])
    rows: list[Tensor | None] = []
    for i in reversed(range(ttt_length)):
        needed = needed | ahead[:, 2 + i : 2 + i + T]  # (B, T) rows with a counted prediction at step i or later
        step_rows = needed.flatten().nonzero().squeeze(1)
        rows.append(step_rows if B * T - step_rows.numel() >= MIN_SKIPPED_ROWS * B * T else None)
    return rows[::-1]


def ttt_loss(
    drafter: Eagle3Drafter,
    target_head: TargetHead,
    batch: Batch,
    *,
    ttt_length: int = 7,
    step_decay: float = 0.8,
    loss_implementation: str = "fused",
) -> TTTOutput:
    """The TTT loss of one batch and its per-step metrics. A batch shorter than 3 tokens has no row to learn
    from; its loss is a zero without gradient, so the caller should not step on it. `loss_implementation` names
    the per-step head and soft cross-entropy, one of LOSS_IMPLEMENTATIONS."""
    if loss_implementation not in LOSS_IMPLEMENTATIONS:
        raise ValueError(f"loss_implementation {loss_implementation!r}: one of {LOSS_IMPLEMENTATIONS}")
    B, T = batch.input_ids.shape  # batch size, sequence length (right-padded)
    device = batch.input_ids.device

    # The fused path trains with the head's gradients taken in forward (`_HeadSoftCrossEntropy`) and on the rows that
    # predict a counted token only; evaluation and the eager reference compute every row's logits as written.
    fused_head = loss_implementation == "fused" and torch.is_grad_enabled() and drafter.lm_head.weight.requires_grad

    # Step 1: the teacher. Position t of the target predicts token t+1; only its draft-vocab part is learnable.
    with torch.no_grad():
        draft_vocab = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size, device=device))  # t2d's ids
        predictable = batch.loss_mask.bool() & batch.attention_mask.bool()  # (B, T) tokens worth predicting
        predicted_batch = predicted_pos = torch.empty(0, dtype=torch.long, device=device)  # the fused path's rows
        step_rows: Sequence[Tensor | None] = [None] * ttt_length  # per step, the rows whose output is used (None: all)
        if fused_head:
            # Token p is predicted by row p-2-i at step i (so p >= 2), and taught by the target's position p-1: the
            # teacher and every step's head and loss need those rows alone. Prompt and padding rows, which count for
            # nothing, then cost no logits (SpecForge computes them all); one host sync a batch for the count.
            predicted_batch, predicted_pos = predictable[:, 2:].nonzero(as_tuple=True)  # (n,) each
            predicted_pos = predicted_pos + 2
            fused_head = predicted_pos.numel() > 0  # nothing to learn: the reference's zero loss, without empty kernels
        if fused_head:
            step_rows = live_rows(predictable, ttt_length)
            counted_states = batch.hidden_state[predicted_batch, predicted_pos - 1]  # (n, H_t)
            target_token, target_p = teacher(target_head, counted_states, draft_vocab)  # (n,), (n, V_draft)
        else:
            target_token, target_p = teacher(target_head, batch.hidden_state.reshape(B * T, -1), draft_vocab)
            target_token, target_p = target_token.view(B, T), target_p.view(B, T, -1)  # (B, T), (B, T, V_draft)
        target_in_draft = drafter.t2d[target_token]  # could the drafter propose it at all?

    # Step 2: step 0's hidden state is the projection of the target's three aux layers. Row t of step i takes token
    # t+1+i: the sequence's embeddings shifted left by 1+i, zeros past its end (those rows predict nothing and feed
    # only their own row's later steps). One padded tensor and a view of it a step: backward keeps one copy, not 7.
    hidden = drafter.project_hidden_states(batch.aux_hidden_state)  # (B, T, 3H_t) -> (B, T, H)
    token_embeds = batch.token_embeds if batch.token_embeds is not None else drafter.embed_input_ids(batch.input_ids)
    shifted_embeds = F.pad(token_embeds, (0, 0, 0, ttt_length))  # (B, T + ttt_length, H)
    position_ids = torch.arange(T, device=device).expand(B, T)
    # Right padding needs no extra mask: under the causal prefix no real row ever sees a padded key.
    cache = TTTCache()
    weights = drafter.backbone_weights()  # cast once for all steps where a compiled backbone would cast at each

    # Step 3: unroll. Each step appends its keys to the cache, so step i attends steps 0..i (the TTT mask).
    zero = torch.zeros((), device=device)
    terms, step_correct, step_counted = [zero] * ttt_length, [zero] * ttt_length, [zero] * ttt_length
    head_gradient = HeadGradient() if fused_head else None
    # lm_head's weight in the compute dtype, cast once for the steps (a cast a step was 0.3 ms at 8B dims on an H100)
    head_weight = autocast_input(drafter.lm_head.weight.detach()) if fused_head else None
    for i in range(ttt_length):
        rows = T - 2 - i  # rows t whose predicted token x_{t+2+i} lies inside the sequence
        if rows <= 0:  # the sequence ends before this step reaches anything; so do all later steps
            break

        # Step 3.1: row t takes token t+1+i (EAGLE's shift of one, plus one per step) at position t+i; the rows no
        # counted prediction needs any more skip the MLP.
        needed_rows = step_rows[i]
        if needed_rows is not None and needed_rows.numel() == 0:
            break  # no counted token left for this step or any later one
        input_embeds = shifted_embeds[:, 1 + i : 1 + i + T]  # (B, T, H)
        hidden = drafter.backbone(
            input_embeds, hidden, position_ids + i, cache=cache, weights=weights, rows=needed_rows
        )  # fed forward

        # Step 3.2: the rows that have a target; 3.3: their logits, and the soft cross-entropy against the teacher, mean
        # over counted rows; each step's term in the loss weighted by step_decay**i (EAGLE-3's 0.8**i: later steps
        # matter less); 3.4: top-1 agreement in target ids, what greedy verification would accept.
        if head_gradient is not None:
            row = predicted_pos - 2 - i  # (n,) the row predicting each counted token at this step
            counted = row >= 0  # the first i tokens' rows would lie before the sequence
            learnable = counted & target_in_draft
            step_counted[i] = counted.sum()
            step_weight = step_decay**i / step_counted[i].clamp(min=1)
            counted_hidden = hidden[predicted_batch, row.clamp(min=0)]  # (n, H)
            assert head_weight is not None  # set with head_gradient
            terms[i], proposed = head_soft_cross_entropy(
                drafter, counted_hidden[None], head_weight, target_p[None], learnable[None], step_weight, head_gradient
            )
            with torch.no_grad():
                proposed = drafter.draft_to_target(proposed[0])  # (n,)
                step_correct[i] = ((proposed == target_token) & counted).sum()
        else:
            teacher_p = target_p[:, 1 + i : 1 + i + rows]  # (B, rows, V_draft) distribution of x_{t+2+i}
            counted = predictable[:, 2 + i : 2 + i + rows]  # (B, rows)
            learnable = counted & target_in_draft[:, 1 + i : 1 + i + rows]  # (B, rows)
            step_counted[i] = counted.sum()
            step_weight = step_decay**i / step_counted[i].clamp(min=1)
            logits = drafter.compute_logits(hidden[:, :rows])  # (B, rows, V_draft)
            cross_entropy_sum, proposed = soft_cross_entropy(logits, teacher_p, learnable)  # (), (B, rows) draft ids
            terms[i] = cross_entropy_sum * step_weight
            with torch.no_grad():
                proposed = drafter.draft_to_target(proposed)  # (B, rows)
                step_correct[i] = ((proposed == target_token[:, 1 + i : 1 + i + rows]) & counted).sum()

    # Step 4: the loss is the sum of the steps' weighted terms; each step's own loss, for the logs, is its term over
    # step_decay**i. One host sync for all the logged numbers, not one per step (it stalls the GPU).
    loss = sum(terms)
    weighted, correct, counted_rows = torch.stack(
        [torch.stack(terms).detach(), torch.stack(step_correct).float(), torch.stack(step_counted).float()]
    ).tolist()
    losses = [term / step_decay**i for i, term in enumerate(weighted)]
    return TTTOutput(
        loss=loss,  # type: ignore[arg-type]  # sum() types an empty sum's 0; ttt_length >= 1 makes it a Tensor
        step_losses=losses,
        step_accuracies=[c / n if n else 0.0 for c, n in zip(correct, counted_rows, strict=True)],
        num_loss_tokens=int(counted_rows[0]),
        step_num_tokens=[int(n) for n in counted_rows],
    )

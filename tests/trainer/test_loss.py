"""The TTT objective: its mask, its step weights, what it ignores, and that it can be learned."""

import math
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from services.trainer import loss as loss_module
from services.trainer.drafter import (
    Eagle3Drafter,
    TargetHead,
    build_drafter,
    causal_mask,
    read_target_config,
    ttt_attention,
    ttt_attention_mask,
)
from services.trainer.loss import (
    LOSS_IMPLEMENTATIONS,
    MIN_SKIPPED_ROWS,
    Batch,
    _row_blocks,
    live_rows,
    soft_cross_entropy,
    soft_cross_entropy_kernel,
    ttt_loss,
    with_token_embeds,
)
from services.trainer.speculative import aux_hidden_state
from shared.data.vocab import VocabMapping, build_vocab_mapping

AUX_LAYER_IDS = [1, 3, 4]


@torch.no_grad()
def captured_batch(
    target: LlamaForCausalLM, sequences: list[list[int]], loss_masks: list[list[int]], aux_layer_ids: list[int]
) -> Batch:
    """What the extraction pipeline would store for these sequences, right-padded into one batch."""
    T = max(len(sequence) for sequence in sequences)
    rows = []
    for sequence in sequences:
        out = target(torch.tensor([sequence]), output_hidden_states=True)
        pad = T - len(sequence)
        rows.append(
            (
                F.pad(aux_hidden_state(out.hidden_states, aux_layer_ids), (0, 0, 0, pad)).to(torch.bfloat16),
                F.pad(out.hidden_states[-1], (0, 0, 0, pad)).to(torch.bfloat16),
            )
        )
    return Batch(
        input_ids=torch.tensor([sequence + [0] * (T - len(sequence)) for sequence in sequences]),
        loss_mask=torch.tensor([mask + [0] * (T - len(mask)) for mask in loss_masks]),
        aux_hidden_state=torch.cat([aux for aux, _ in rows]),
        hidden_state=torch.cat([hidden for _, hidden in rows]),
        attention_mask=torch.tensor([[True] * len(s) + [False] * (T - len(s)) for s in sequences]),
    )


def mapping_for(target_vocab_size: int, draft_vocab_size: int) -> VocabMapping:
    counts = Counter({token: 2 if token % 3 else 1 for token in range(target_vocab_size)})
    return build_vocab_mapping(counts, target_vocab_size=target_vocab_size, draft_vocab_size=draft_vocab_size)


@pytest.fixture(scope="module")
def tiny_target(tiny_model_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def random_sequences(tiny_target: LlamaForCausalLM) -> tuple[list[list[int]], list[list[int]]]:
    """Random prompts of different lengths; the second half of each is the 'assistant' part to learn."""
    generator = torch.Generator().manual_seed(0)
    vocab_size = tiny_target.config.vocab_size
    sequences = [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for length in (24, 31, 18, 27)]
    masks = [[0] * (len(s) // 2) + [1] * (len(s) - len(s) // 2) for s in sequences]
    return sequences, masks


def fresh_drafter(model_dir: Path, draft_vocab_size: int, seed: int = 0) -> tuple[Eagle3Drafter, TargetHead]:
    torch.manual_seed(seed)
    mapping = mapping_for(read_target_config(model_dir)["vocab_size"], draft_vocab_size)
    return build_drafter(model_dir, mapping, aux_layer_ids=AUX_LAYER_IDS)


def test_ttt_mask_is_causal_prefix_plus_own_diagonal() -> None:
    T, steps = 5, 3
    mask = ttt_attention_mask(T, steps)
    assert mask.shape == (T, steps * T)
    block0, later = mask[:, :T], mask[:, T:].reshape(T, steps - 1, T)
    assert torch.equal(block0, torch.tril(torch.ones(T, T, dtype=torch.bool)))  # causal over real features
    for j in range(steps - 1):
        assert torch.equal(later[:, j], torch.eye(T, dtype=torch.bool))  # only its own earlier draft steps
    assert mask.sum(-1).tolist() == [t + steps for t in range(T)]  # row t sees t+1 prefix keys + (steps-1) own


def test_ttt_attention_equals_masked_attention_over_all_steps() -> None:
    generator = torch.Generator().manual_seed(0)
    B, nh, nkv, T, D, steps = 2, 4, 2, 6, 8, 3
    query = torch.randn(B, nh, T, D, generator=generator)
    keys = [torch.randn(B, nkv, T, D, generator=generator) for _ in range(steps)]
    values = [torch.randn(B, nkv, T, D, generator=generator) for _ in range(steps)]
    factored = ttt_attention(query, keys, values, causal_mask(T, T, query.device), 1 / math.sqrt(D))
    explicit = F.scaled_dot_product_attention(
        query, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=ttt_attention_mask(T, steps), enable_gqa=True
    )
    torch.testing.assert_close(factored, explicit, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("step_decay", [0.8, 0.5])
def test_loss_is_step_losses_weighted_by_decay_powers(
    tiny_model_dir: Path, tiny_target: LlamaForCausalLM, random_sequences: tuple, step_decay: float
) -> None:
    drafter, target_head = fresh_drafter(tiny_model_dir, draft_vocab_size=300)
    batch = captured_batch(tiny_target, *random_sequences, AUX_LAYER_IDS)
    out = ttt_loss(drafter, target_head, batch, ttt_length=5, step_decay=step_decay)
    assert len(out.step_losses) == len(out.step_accuracies) == len(out.step_num_tokens) == 5
    expected = sum(step_decay**i * loss for i, loss in enumerate(out.step_losses))
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    # Row t at step i predicts token t+2+i: in-mask tokens from position 2 + i on count.
    mask = batch.loss_mask.bool() & batch.attention_mask
    assert out.step_num_tokens == [int(mask[:, 2 + i :].sum()) for i in range(5)]
    assert out.num_loss_tokens == out.step_num_tokens[0]


def test_padding_changes_nothing(tiny_model_dir: Path, tiny_target: LlamaForCausalLM, random_sequences: tuple) -> None:
    drafter, target_head = fresh_drafter(tiny_model_dir, draft_vocab_size=300)
    sequences, masks = random_sequences
    alone = captured_batch(tiny_target, sequences[:1], masks[:1], AUX_LAYER_IDS)
    padded = captured_batch(
        tiny_target, [sequences[0], sequences[1]], [masks[0], [0] * len(sequences[1])], AUX_LAYER_IDS
    )
    # The second row only pads the first out to its length, with no token to learn; then junk goes into the padding.
    padded = Batch(**{name: tensor[:1] for name, tensor in vars(padded).items() if tensor is not None})
    L = len(sequences[0])
    assert padded.input_ids.shape[1] > L
    reference = ttt_loss(drafter, target_head, alone)
    for seed in (1, 2):
        generator = torch.Generator().manual_seed(seed)
        junk = Batch(**{name: tensor.clone() for name, tensor in vars(padded).items() if tensor is not None})
        junk.input_ids[:, L:] = torch.randint(0, 400, junk.input_ids[:, L:].shape, generator=generator)
        junk.loss_mask[:, L:] = 1  # even a loss mask set on padding must not count
        junk.aux_hidden_state[:, L:] = 50 * torch.randn(junk.aux_hidden_state[:, L:].shape, generator=generator)
        junk.hidden_state[:, L:] = 50 * torch.randn(junk.hidden_state[:, L:].shape, generator=generator)
        out = ttt_loss(drafter, target_head, junk)
        torch.testing.assert_close(out.loss, reference.loss, rtol=1e-5, atol=1e-6)
        assert out.step_accuracies == reference.step_accuracies
        assert out.step_num_tokens == reference.step_num_tokens


def test_embeddings_looked_up_by_the_loader_train_as_the_drafters_own(
    tiny_model_dir: Path, tiny_target: LlamaForCausalLM, random_sequences: tuple
) -> None:
    """The trainer's loader looks each batch's tokens up in the embedding kept on the host (`with_token_embeds`): the
    loss, the metrics and every gradient are those of the drafter looking them up itself, on every loss path."""
    batch = captured_batch(tiny_target, *random_sequences, AUX_LAYER_IDS)
    for loss_implementation in LOSS_IMPLEMENTATIONS:
        runs = []
        for looked_up in (False, True):
            drafter, target_head = fresh_drafter(tiny_model_dir, draft_vocab_size=300)
            given = with_token_embeds(batch, drafter.embed_tokens.weight.detach()) if looked_up else batch
            assert (given.token_embeds is not None) == looked_up
            out = ttt_loss(drafter, target_head, given, loss_implementation=loss_implementation)
            out.loss.backward()
            runs.append((out, {name: p.grad for name, p in drafter.named_parameters() if p.requires_grad}))
        (own, own_grads), (loaded, loaded_grads) = runs
        assert torch.equal(loaded.loss, own.loss), loss_implementation
        assert (loaded.step_accuracies, loaded.step_num_tokens) == (own.step_accuracies, own.step_num_tokens)
        for name, grad in own_grads.items():
            assert torch.equal(loaded_grads[name], grad), (loss_implementation, name)


def test_placed_models_keep_the_token_embedding_on_the_host(tiny_model_dir: Path) -> None:
    """On a GPU the embedding table stays in host memory, where the loader reads it; everything else moves. (The
    "meta" device stands in for a GPU: nothing is allocated.)"""
    from services.trainer.step import place_models

    drafter, target_head = fresh_drafter(tiny_model_dir, draft_vocab_size=300)
    place_models(drafter, target_head, torch.device("meta"))
    assert drafter.embed_tokens.weight.device.type == "cpu" and not drafter.embed_tokens.weight.requires_grad
    assert {p.device.type for name, p in drafter.named_parameters() if name != "embed_tokens.weight"} == {"meta"}
    assert target_head.weight.device.type == "meta" and drafter.t2d.device.type == "meta"


def test_teachers_of_unmasked_tokens_change_nothing(
    tiny_model_dir: Path, tiny_target: LlamaForCausalLM, random_sequences: tuple
) -> None:
    drafter, target_head = fresh_drafter(tiny_model_dir, draft_vocab_size=300)
    batch = captured_batch(tiny_target, *random_sequences, AUX_LAYER_IDS)
    reference = ttt_loss(drafter, target_head, batch)
    # hidden_state[p] is the teacher for token p+1; where that token is not in the loss mask it must not matter.
    counted_next = F.pad((batch.loss_mask.bool() & batch.attention_mask)[:, 1:], (0, 1))  # shifted left by 1
    changed = batch.hidden_state.clone()
    changed[~counted_next] = 10 * torch.randn_like(changed[~counted_next])
    out = ttt_loss(drafter, target_head, replace(batch, hidden_state=changed))
    torch.testing.assert_close(out.loss, reference.loss, rtol=1e-6, atol=1e-6)
    # ...and the teacher of a counted token does matter (the check above is not vacuous).
    changed = batch.hidden_state.clone()
    changed[counted_next] = 10 * torch.randn_like(changed[counted_next])
    assert not torch.allclose(ttt_loss(drafter, target_head, replace(batch, hidden_state=changed)).loss, reference.loss)


def test_overfitting_one_batch_lowers_loss_and_raises_accuracy(
    tiny_model_dir: Path, tiny_target: LlamaForCausalLM, random_sequences: tuple
) -> None:
    drafter, target_head = fresh_drafter(tiny_model_dir, draft_vocab_size=300)
    batch = captured_batch(tiny_target, *random_sequences, AUX_LAYER_IDS)
    # A random target's next-token distributions are nearly uniform (logit std ~0.15), so the soft cross-entropy
    # could only fall to that entropy. Scaling its final state sharpens the teacher without moving its argmax.
    batch = replace(batch, hidden_state=batch.hidden_state * 30)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    history = []
    for _ in range(50):
        out = ttt_loss(drafter, target_head, batch, ttt_length=3)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        history.append(out)
    first, last = history[0], history[-1]
    assert last.loss.item() < 0.5 * first.loss.item(), [round(h.loss.item(), 3) for h in history[::10]]
    assert last.step_accuracies[0] > first.step_accuracies[0] + 0.3, (first.step_accuracies, last.step_accuracies)


def soft_cross_entropy_outputs(
    logits_dtype: torch.dtype, device: str, *, kernel: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(masked sum, argmax, d(0.8 * sum)/d logits) on random logits and a sharp random teacher: from autograd through
    the eager soft cross-entropy, or (`kernel`) from the fused path's kernel (compiled on CUDA), which gives the
    gradient in forward with the row weights (0.8 * learnable) folded in."""
    generator = torch.Generator(device).manual_seed(seed)
    B, R, V = 3, 50, 700
    logits = (3 * torch.randn(B, R, V, generator=generator, device=device)).to(logits_dtype)
    teacher_p = (4 * torch.randn(B, R, V, generator=generator, device=device)).softmax(-1)
    learnable = torch.rand(B, R, generator=generator, device=device) < 0.7
    if kernel:
        total, grad, argmax = soft_cross_entropy_kernel(logits)(logits, teacher_p, 0.8 * learnable.float())
        return total / 0.8, argmax, grad
    logits.requires_grad_()
    total, argmax = soft_cross_entropy(logits, teacher_p, learnable)
    (grad,) = torch.autograd.grad(0.8 * total, logits)  # a step weight upstream, as in ttt_loss
    return total, argmax, grad


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_fused_kernel_gives_the_eager_loss_and_its_gradient(logits_dtype: torch.dtype) -> None:
    eager = soft_cross_entropy_outputs(logits_dtype, "cpu", kernel=False)
    fused = soft_cross_entropy_outputs(logits_dtype, "cpu", kernel=True)
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-6, atol=1e-4)
    assert torch.equal(fused[1], eager[1])
    # bf16: both gradients are rounded once to bf16, from fp32 values summed in different orders.
    tolerance = {"rtol": 1e-5, "atol": 1e-7} if logits_dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-6}
    torch.testing.assert_close(fused[2], eager[2], **tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the soft cross-entropy's kernels run on CUDA")
@pytest.mark.parametrize("kernel", loss_module.SOFT_CROSS_ENTROPY_KERNELS)
def test_soft_cross_entropy_kernels_match_eager_on_cuda(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss_module, "SOFT_CROSS_ENTROPY_ON_CUDA", kernel)
    eager = soft_cross_entropy_outputs(torch.bfloat16, "cuda", kernel=False)
    fused = soft_cross_entropy_outputs(torch.bfloat16, "cuda", kernel=True)
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-5, atol=1e-3)
    assert torch.equal(fused[1], eager[1])
    torch.testing.assert_close(fused[2], eager[2], rtol=1e-2, atol=1e-6)


def test_fast_paths_give_the_eager_loss_metrics_and_gradients(
    tiny_model_dir: Path, tiny_target: LlamaForCausalLM, random_sequences: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    drafter, target_head = fresh_drafter(tiny_model_dir, draft_vocab_size=300)
    batch = captured_batch(tiny_target, *random_sequences, AUX_LAYER_IDS)
    batch = replace(batch, hidden_state=batch.hidden_state * 30)  # a sharp teacher, so accuracy is not all zero
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    for _ in range(15):  # a little training, so that some drafts are right and accuracy is compared too
        optimizer.zero_grad(set_to_none=True)
        ttt_loss(drafter, target_head, batch, ttt_length=3).loss.backward()
        optimizer.step()

    def loss_and_grads(attn_implementation: str, loss_implementation: str, recompute: str = "") -> tuple:
        drafter.config.attn_implementation = attn_implementation
        drafter.config.recompute_mlp = "mlp" in recompute
        out = ttt_loss(drafter, target_head, batch, loss_implementation=loss_implementation)
        return out, torch.autograd.grad(out.loss, params)

    reference, reference_grads = loss_and_grads("eager", "eager")
    assert any(reference.step_accuracies), "all-zero accuracies would make the comparison vacuous"
    # From here the teacher and the heads take a few rows at a time, against the reference's one chunk: 5 rows (several
    # blocks per sequence, a short last one), then 60 rows (two whole sequences a block).
    assert 5 < batch.input_ids.shape[1] - 2 <= 60 // 2  # step 0 has T - 2 rows
    for rows_at_once in (5, 60):
        monkeypatch.setattr(loss_module, "HEAD_CHUNK_ELEMENTS", rows_at_once * drafter.config.draft_vocab_size)
        for variant in [
            ("sdpa", "eager"),
            ("eager", "fused"),
            ("sdpa", "fused"),
            ("sdpa", "fused", "mlp"),
        ]:
            out, grads = loss_and_grads(*variant)
            torch.testing.assert_close(out.loss, reference.loss, rtol=1e-6, atol=1e-6)
            assert out.step_losses == pytest.approx(reference.step_losses, rel=1e-5)
            assert out.step_accuracies == reference.step_accuracies
            assert out.step_num_tokens == reference.step_num_tokens
            for got, expected in zip(grads, reference_grads, strict=True):
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)

    # The fused head's weight gradient, summed over the steps in forward, follows the caller's factor on the loss.
    drafter.config.recompute_mlp = False
    out = ttt_loss(drafter, target_head, batch)
    (scaled,) = torch.autograd.grad(out.loss * 3.0, [drafter.lm_head.weight])
    torch.testing.assert_close(
        scaled, 3.0 * reference_grads[params_index(drafter, "lm_head.weight")], rtol=1e-4, atol=1e-6
    )


def test_rows_no_counted_prediction_needs_skip_the_mlp(
    tiny_model_dir: Path, tiny_target: LlamaForCausalLM, random_sequences: tuple
) -> None:
    """Row t predicts token t+2+j at step j, and its state at step i feeds only its own later steps: the fused path
    runs the MLP on a step's rows only while one of their predictions from that step on counts. Prompts and padding
    (half of each sequence here, and up to 13 padded rows) cost no MLP; that it changes no loss or gradient is
    `test_fast_paths_give_the_eager_loss_metrics_and_gradients`'s to check."""
    drafter, target_head = fresh_drafter(tiny_model_dir, draft_vocab_size=300)
    batch = captured_batch(tiny_target, *random_sequences, AUX_LAYER_IDS)
    B, T = batch.input_ids.shape
    predictable = (batch.loss_mask.bool() & batch.attention_mask).tolist()
    steps = 7
    expected = [
        sum(
            any(t + 2 + j < T and predictable[b][t + 2 + j] for j in range(i, steps))
            for b in range(B)
            for t in range(T)
        )
        for i in range(steps)
    ]
    mlp_rows: list[int] = []
    hook = drafter.midlayer.mlp.register_forward_hook(lambda module, args, out: mlp_rows.append(args[0].shape[0]))
    try:
        ttt_loss(drafter, target_head, batch, ttt_length=steps).loss.backward()
        assert mlp_rows == expected
        assert all(rows < B * T for rows in expected) and expected == sorted(expected, reverse=True)

        mlp_rows.clear()
        with torch.no_grad():  # evaluation computes every row, as the reference does
            ttt_loss(drafter, target_head, batch, ttt_length=steps)
        assert len(mlp_rows) == steps and all(rows == B for rows in mlp_rows)  # (B, T, H): dim 0 is the batch
    finally:
        hook.remove()


def test_a_step_skips_rows_only_where_enough_of_them_need_no_output() -> None:
    """Where every token is learned, step i leaves the last 2 + i rows of a sequence without a counted prediction:
    at 64 tokens fewer than MIN_SKIPPED_ROWS (1/16, 4 rows) at steps 0 and 1, whose MLP takes every row (None), and
    enough from step 2 on. A prompt of half the sequence is skipped at every step."""
    T, steps = 64, 7
    assert MIN_SKIPPED_ROWS == 1 / 16
    learned = torch.ones(1, T, dtype=torch.bool)
    rows = live_rows(learned, steps)
    assert [r is None for r in rows] == [True, True, False, False, False, False, False]
    for i, step_rows in enumerate(rows[2:], start=2):
        assert step_rows is not None and step_rows.tolist() == list(range(T - 2 - i))

    prompted = learned.clone()
    prompted[:, : T // 2] = False  # tokens 0..31 are the prompt: rows from 30 - i on predict the answer at step i
    for i, step_rows in enumerate(live_rows(prompted, steps)):
        assert step_rows is not None and step_rows.tolist() == list(range(T // 2 - 2 - (steps - 1), T - 2 - i))


def test_a_batch_with_nothing_to_learn_gives_a_zero_loss_on_every_path(
    tiny_model_dir: Path, tiny_target: LlamaForCausalLM, random_sequences: tuple
) -> None:
    drafter, target_head = fresh_drafter(tiny_model_dir, draft_vocab_size=300)
    batch = captured_batch(tiny_target, *random_sequences, AUX_LAYER_IDS)
    batch = replace(batch, loss_mask=torch.zeros_like(batch.loss_mask))  # all prompt: no row is counted
    for loss_implementation in LOSS_IMPLEMENTATIONS:
        out = ttt_loss(drafter, target_head, batch, ttt_length=3, loss_implementation=loss_implementation)
        assert float(out.loss) == 0.0 and out.step_num_tokens == [0, 0, 0], loss_implementation
        out.loss.backward()  # a graph to step on, whose gradients are all zero
        assert all(not p.grad.any() for p in drafter.parameters() if p.grad is not None)
        drafter.zero_grad(set_to_none=True)


def params_index(drafter: Eagle3Drafter, name: str) -> int:
    names = [n for n, p in drafter.named_parameters() if p.requires_grad]
    return names.index(name)


@pytest.mark.parametrize(("batch", "rows", "rows_at_once"), [(4, 29, 5), (4, 29, 60), (3, 7, 7), (1, 10, 3), (5, 1, 2)])
def test_head_row_blocks_cover_every_row_once(batch: int, rows: int, rows_at_once: int) -> None:
    seen = torch.zeros(batch, rows, dtype=torch.long)
    for block in _row_blocks(batch, rows, rows_at_once=rows_at_once):
        seen[block] += 1
        assert seen[block].numel() <= max(rows_at_once, 1) or seen[block].shape[0] == 1, block
    assert (seen == 1).all(), seen


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 autocast on the GPU, as the trainer runs there")
def test_fused_and_recomputing_paths_give_the_eager_loss_and_gradients_on_cuda_in_bf16() -> None:
    from bench.trainer_throughput import random_models
    from bench.vs_specforge import DIMS, random_batch
    from services.trainer.step import autocast, place_models

    device = torch.device("cuda")
    drafter, target_head = random_models(DIMS["tiny"])
    place_models(drafter, target_head, device)
    # The tokens' embeddings looked up on the host, where placement keeps the table, as the trainer's loader does.
    batch = with_token_embeds(random_batch(DIMS["tiny"], 2, 64, seed=1), drafter.embed_tokens.weight.detach())
    batch = batch.to(device)
    params = [p for p in drafter.parameters() if p.requires_grad]

    def loss_and_grads(recompute: bool, loss_implementation: str = "fused") -> tuple:
        drafter.config.recompute_mlp = recompute
        with autocast(device):
            out = ttt_loss(drafter, target_head, batch, loss_implementation=loss_implementation)
        return out, torch.autograd.grad(out.loss, params)

    # The eager logits and loss as autograd differentiates them, against the fused head (gradients taken in forward)
    # and the recomputing paths: all in bf16 under autocast, so within bf16's rounding of each other.
    kept, kept_grads = loss_and_grads(False, loss_implementation="eager")
    for recompute in (False, True):
        got, got_grads = loss_and_grads(recompute)
        torch.testing.assert_close(got.loss, kept.loss, rtol=1e-3, atol=1e-4)
        assert got.step_accuracies == kept.step_accuracies
        for grad, expected in zip(got_grads, kept_grads, strict=True):
            assert (grad - expected).norm() <= 2e-2 * expected.norm() + 1e-6

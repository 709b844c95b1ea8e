"""Evaluation: the simulated acceptance formula, held-out averaging, and real speculative decoding on the tiny
target: always exactly greedy decoding, accepting whole chains from an oracle, partial chains from a partly
wrong oracle, nothing much from an untrained drafter, and clearly more once trained on the target's own states."""

import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import LlamaForCausalLM

from services.trainer.drafter import (
    DrafterConfig,
    Eagle3Drafter,
    KVCache,
    TargetHead,
    TTTCache,
    build_drafter,
    read_target_config,
)
from services.trainer.evaluate import evaluate_heldout, simulated_acceptance_length
from services.trainer.loss import Batch, ttt_loss
from services.trainer.speculative import (
    cache_argument,
    greedy_generate,
    measure_acceptance,
    speculative_generate,
)
from shared.data.vocab import build_vocab_mapping
from tests.trainer.test_loss import AUX_LAYER_IDS, captured_batch

NUM_DRAFT_TOKENS = 4
MAX_NEW_TOKENS = 32


class OracleDrafter(Eagle3Drafter):
    """Proposes the target's greedy continuation, read from reference sequences [B, L].

    It uses the convention both the loss and decoding rely on: the row at RoPE position p (the target's features
    of position p, token p+1) predicts token p+2. With `correct_drafts=m` it proposes a wrong token from the
    (m+1)-th draft of every chain on, so exactly m drafts are accepted per verification step.
    """

    def __init__(self, config: DrafterConfig, sequences: Tensor, correct_drafts: int | None = None) -> None:
        super().__init__(config)
        self.sequences = sequences
        self.correct_drafts = correct_drafts
        self.positions = torch.zeros(0, dtype=torch.long)
        self.rows_from_start = True
        self.chain_length = 0

    def project_hidden_states(self, aux_hidden_state: Tensor) -> Tensor:
        self.chain_length = 0  # decoding projects target features once per verification step, then drafts
        return super().project_hidden_states(aux_hidden_state)

    def backbone(
        self,
        input_embeds: Tensor,
        hidden_states: Tensor,
        position_ids: Tensor,
        cache: KVCache | TTTCache | None = None,
        attention_mask: Tensor | None = None,
        weights: dict[str, Tensor] | None = None,
        rows: Tensor | None = None,
    ) -> Tensor:
        self.positions = position_ids.expand(input_embeds.shape[:2])
        self.rows_from_start = isinstance(cache, TTTCache)  # the loss takes logits of the first rows, decoding the last
        self.chain_length += 1
        return super().backbone(input_embeds, hidden_states, position_ids, cache, attention_mask, rows=rows)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        rows = hidden_states.shape[1]
        positions = self.positions[:, :rows] if self.rows_from_start else self.positions[:, -rows:]
        index = (positions + 2).clamp(max=self.sequences.shape[1] - 1)
        tokens = self.sequences.gather(1, index)  # (B, rows) target ids; the vocab mapping is the identity
        if self.correct_drafts is not None and self.chain_length > self.correct_drafts:
            tokens = (tokens + 1) % self.config.draft_vocab_size
        return 100.0 * F.one_hot(tokens, self.config.draft_vocab_size).float()


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target with an untied, confident lm_head that maps each token to a fixed other one.

    The random tiny target on its own repeats one token forever, where predicting token t+1 or t+2 is the same
    thing, so no test could tell a shifted convention from the right one. With lm_head = 50 * embedding[perm],
    its greedy text walks through a permutation instead, and its distributions are sharp enough to learn quickly.
    """
    target = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    perm = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(0))
    target.config.tie_word_embeddings = False
    target.lm_head.weight = torch.nn.Parameter(50 * target.model.embed_tokens.weight.detach()[perm].clone())
    out_dir = tmp_path_factory.mktemp("tiny-permutation-target")
    target.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def tiny_target(target_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts_and_continuations(tiny_target: LlamaForCausalLM) -> tuple[list[list[int]], list[list[int]]]:
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, tiny_target.config.vocab_size, (8,), generator=generator).tolist() for _ in range(3)]
    with torch.no_grad():
        continuations = [greedy_generate(tiny_target, prompt, max_new_tokens=MAX_NEW_TOKENS) for prompt in prompts]
    assert all(len(c) > NUM_DRAFT_TOKENS + 1 for c in continuations), "the tiny target stopped too early"
    return prompts, continuations


def full_vocab_drafter(model_dir: Path, seed: int = 0) -> tuple[Eagle3Drafter, TargetHead]:
    torch.manual_seed(seed)
    vocab_size = read_target_config(model_dir)["vocab_size"]
    mapping = build_vocab_mapping(Counter(range(vocab_size)), target_vocab_size=vocab_size, draft_vocab_size=vocab_size)
    return build_drafter(model_dir, mapping, aux_layer_ids=AUX_LAYER_IDS)


def oracle_for(drafter: Eagle3Drafter, sequences: list[list[int]], correct_drafts: int | None = None) -> OracleDrafter:
    length = max(len(s) for s in sequences)
    padded = torch.tensor([s + [0] * (length - len(s)) for s in sequences])
    oracle = OracleDrafter(drafter.config, padded, correct_drafts)
    oracle.load_state_dict(drafter.state_dict())
    return oracle


def test_simulated_acceptance_length_sums_running_products() -> None:
    assert simulated_acceptance_length([]) == 0.0
    assert simulated_acceptance_length([1.0, 1.0, 1.0]) == 3.0
    assert simulated_acceptance_length([0.5, 0.5]) == pytest.approx(0.5 + 0.25)
    assert simulated_acceptance_length([0.8, 0.5, 0.0, 1.0]) == pytest.approx(0.8 + 0.4)


def test_heldout_metrics_are_token_weighted(
    target_dir: Path, tiny_target: LlamaForCausalLM, prompts_and_continuations: tuple
) -> None:
    drafter, target_head = full_vocab_drafter(target_dir)
    prompts, continuations = prompts_and_continuations
    sequences = [p + c for p, c in zip(prompts, continuations, strict=True)]
    masks = [[0] * len(p) + [1] * len(c) for p, c in zip(prompts, continuations, strict=True)]
    batches = [
        captured_batch(tiny_target, sequences[:1], masks[:1], AUX_LAYER_IDS),
        captured_batch(tiny_target, [sequences[1][:20], sequences[2]], [masks[1][:20], masks[2]], AUX_LAYER_IDS),
    ]
    result = evaluate_heldout(oracle_for(drafter, [sequences[0]]), target_head, batches[:1], ttt_length=3)
    assert result["acc_per_position"] == [1.0, 1.0, 1.0]  # the oracle, on the batch it knows

    result = evaluate_heldout(drafter, target_head, batches, ttt_length=3)
    outs = [ttt_loss(drafter, target_head, batch, ttt_length=3) for batch in batches]
    for i in range(3):
        tokens = sum(out.step_num_tokens[i] for out in outs)
        assert result["acc_per_position"][i] == pytest.approx(
            sum(out.step_accuracies[i] * out.step_num_tokens[i] for out in outs) / tokens
        )
        assert result["loss_per_position"][i] == pytest.approx(
            sum(out.step_losses[i] * out.step_num_tokens[i] for out in outs) / tokens, rel=1e-5
        )
    assert result["num_tokens"] == sum(out.num_loss_tokens for out in outs)
    assert result["simulated_acceptance_length"] == pytest.approx(
        simulated_acceptance_length(result["acc_per_position"])
    )
    assert drafter.training, "evaluation must leave the drafter in the mode it found it"


def test_training_and_decoding_share_one_shift_convention(
    target_dir: Path, tiny_target: LlamaForCausalLM, prompts_and_continuations: tuple
) -> None:
    """An oracle built on 'row at position p predicts token p+2' is perfect in the TTT accuracy on greedy text
    and has every draft accepted in decoding; shifting its convention by one breaks the loss side."""
    drafter, target_head = full_vocab_drafter(target_dir)
    prompts, continuations = prompts_and_continuations
    sequences = [p + c for p, c in zip(prompts, continuations, strict=True)]
    masks = [[0] * len(p) + [1] * len(c) for p, c in zip(prompts, continuations, strict=True)]
    batch = captured_batch(tiny_target, sequences, masks, AUX_LAYER_IDS)

    # Without gradients the loss reads the oracle's logits (training's fused head computes them from lm_head itself).
    oracle = oracle_for(drafter, sequences)
    with torch.no_grad():
        assert ttt_loss(oracle, target_head, batch, ttt_length=4).step_accuracies == [1.0] * 4
        shifted = oracle_for(drafter, [s[1:] for s in sequences])  # predicts token p+3 instead
        assert ttt_loss(shifted, target_head, batch, ttt_length=4).step_accuracies[0] < 0.5

    for sequence, prompt, continuation in zip(sequences, prompts, continuations, strict=True):
        output = speculative_generate(
            tiny_target,
            oracle_for(drafter, [sequence]),
            prompt,
            num_draft_tokens=NUM_DRAFT_TOKENS,
            max_new_tokens=MAX_NEW_TOKENS,
        )
        assert output.tokens == continuation
        # After the prefill's token, every step emits all drafts plus the bonus token until the budget runs out.
        emitted = output.emitted_per_step
        assert emitted[:-1] == [NUM_DRAFT_TOKENS + 1] * (len(emitted) - 1)
        assert output.accepted_per_step[:-1] == [NUM_DRAFT_TOKENS] * (len(emitted) - 1)
        assert sum(emitted) == len(continuation) - 1


def test_oracle_decoding_matches_greedy_with_full_chains(
    target_dir: Path, tiny_target: LlamaForCausalLM, prompts_and_continuations: tuple
) -> None:
    drafter, _ = full_vocab_drafter(target_dir)
    prompts, continuations = prompts_and_continuations
    prompt, continuation = prompts[0], continuations[0]
    result = measure_acceptance(
        tiny_target,
        oracle_for(drafter, [prompt + continuation]),
        [prompt],
        num_draft_tokens=NUM_DRAFT_TOKENS,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    steps = -(-(len(continuation) - 1) // (NUM_DRAFT_TOKENS + 1))  # ceil
    assert result.matches_greedy
    assert (result.steps, result.tokens) == (steps, len(continuation))
    assert result.mean_accepted_per_step == pytest.approx((len(continuation) - 1) / steps)


def test_partly_wrong_oracle_accepts_exactly_its_correct_prefix(
    target_dir: Path, tiny_target: LlamaForCausalLM, prompts_and_continuations: tuple
) -> None:
    drafter, _ = full_vocab_drafter(target_dir)
    prompts, continuations = prompts_and_continuations
    for prompt, continuation in zip(prompts, continuations, strict=True):
        output = speculative_generate(
            tiny_target,
            oracle_for(drafter, [prompt + continuation], correct_drafts=2),
            prompt,
            num_draft_tokens=NUM_DRAFT_TOKENS,
            max_new_tokens=MAX_NEW_TOKENS,
        )
        assert output.tokens == continuation  # rejected drafts never leak into the output or the caches
        emitted = output.emitted_per_step
        assert emitted[:-1] == [3] * (len(emitted) - 1)  # 2 accepted drafts + the target's correction
        assert output.accepted_per_step[:-1] == [2] * (len(emitted) - 1)


def test_acceptance_per_position_and_per_prompt_interval(
    target_dir: Path, tiny_target: LlamaForCausalLM, prompts_and_continuations: tuple
) -> None:
    """An oracle right on its first two drafts only: positions 1-2 accepted (all but perhaps the last step,
    which drafts past the reference), positions 3-4 never; one acceptance length per prompt, and an interval
    around their mean."""
    drafter, _ = full_vocab_drafter(target_dir)
    prompts, continuations = prompts_and_continuations
    results = [
        measure_acceptance(
            tiny_target,
            oracle_for(drafter, [prompt + continuation], correct_drafts=2),
            [prompt],
            num_draft_tokens=NUM_DRAFT_TOKENS,
            max_new_tokens=MAX_NEW_TOKENS,
        )
        for prompt, continuation in zip(prompts, continuations, strict=True)
    ]
    for result in results:
        assert result.matches_greedy and result.prompts == 1 and len(result.prompt_acceptance_lengths) == 1
        first, second, third, fourth = result.position_acceptance
        assert first >= second >= (result.steps - 1) / result.steps and (third, fourth) == (0.0, 0.0)
        assert result.mean_acceptance_length == pytest.approx(result.mean_accepted_per_step)
        assert all(map(math.isnan, result.acceptance_length_ci95))  # one prompt: no interval
    pooled = measure_acceptance(
        tiny_target, drafter, prompts, num_draft_tokens=NUM_DRAFT_TOKENS, max_new_tokens=MAX_NEW_TOKENS
    )
    assert pooled.prompts == len(prompts) == len(pooled.prompt_acceptance_lengths)
    low, high = pooled.acceptance_length_ci95
    assert low <= pooled.mean_acceptance_length <= high


def test_untrained_drafter_decodes_exactly_greedy(
    target_dir: Path, tiny_target: LlamaForCausalLM, prompts_and_continuations: tuple
) -> None:
    drafter, _ = full_vocab_drafter(target_dir)
    prompts, _ = prompts_and_continuations
    result = measure_acceptance(
        tiny_target, drafter, prompts, num_draft_tokens=NUM_DRAFT_TOKENS, max_new_tokens=MAX_NEW_TOKENS
    )
    assert result.matches_greedy
    assert 1.0 <= result.mean_accepted_per_step < 1.5
    assert drafter.training

    # Without the greedy check (the serving-engine eval's own column): the same acceptance, the check not claimed.
    unchecked = measure_acceptance(
        tiny_target,
        drafter,
        prompts,
        num_draft_tokens=NUM_DRAFT_TOKENS,
        max_new_tokens=MAX_NEW_TOKENS,
        check_greedy=False,
    )
    assert unchecked.matches_greedy is None
    assert unchecked.prompt_acceptance_lengths == result.prompt_acceptance_lengths


def test_training_on_the_targets_own_states_raises_measured_acceptance(
    target_dir: Path, tiny_target: LlamaForCausalLM, prompts_and_continuations: tuple
) -> None:
    drafter, target_head = full_vocab_drafter(target_dir)
    prompts, continuations = prompts_and_continuations
    untrained = measure_acceptance(
        tiny_target, drafter, prompts, num_draft_tokens=NUM_DRAFT_TOKENS, max_new_tokens=MAX_NEW_TOKENS
    )

    batch: Batch = captured_batch(
        tiny_target,
        [p + c for p, c in zip(prompts, continuations, strict=True)],
        [[0] * len(p) + [1] * len(c) for p, c in zip(prompts, continuations, strict=True)],
        AUX_LAYER_IDS,
    )
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(60):
        out = ttt_loss(drafter, target_head, batch, ttt_length=NUM_DRAFT_TOKENS)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()

    trained = measure_acceptance(
        tiny_target, drafter, prompts, num_draft_tokens=NUM_DRAFT_TOKENS, max_new_tokens=MAX_NEW_TOKENS
    )
    assert untrained.matches_greedy and trained.matches_greedy
    assert trained.mean_accepted_per_step > untrained.mean_accepted_per_step + 1.0, (untrained, trained, out)


class PastKeyValuesTarget(LlamaForCausalLM):
    """A target with the forward signature of transformers before 5.24 (SGLang 0.5.23 pins 5.19): the KV cache
    is `past_key_values`, and a keyword it does not know, such as 5.24's `cache`, is swallowed by `**kwargs`."""

    def forward(self, input_ids: Tensor | None = None, past_key_values: object = None, **kwargs: object) -> object:
        kwargs.pop("cache", None)
        return super().forward(input_ids=input_ids, cache=past_key_values, **kwargs)


def test_decoding_finds_the_cache_argument_of_older_transformers(
    target_dir: Path, tiny_target: LlamaForCausalLM, prompts_and_continuations: tuple
) -> None:
    """Seen on the GPU machine (transformers 5.19): a cache passed as `cache=` was dropped without an error, and
    verification cropped an empty cache. The keyword is read from the signature."""
    older = PastKeyValuesTarget(tiny_target.config).eval()
    older.load_state_dict(tiny_target.state_dict())
    assert (cache_argument(tiny_target), cache_argument(older)) == ("cache", "past_key_values")

    drafter, _ = full_vocab_drafter(target_dir)
    prompts, continuations = prompts_and_continuations
    output = speculative_generate(
        older,
        oracle_for(drafter, [prompts[0] + continuations[0]]),
        prompts[0],
        num_draft_tokens=NUM_DRAFT_TOKENS,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    assert output.tokens == continuations[0]

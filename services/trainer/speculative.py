"""Measured acceptance: greedy *chain* speculative decoding of a Hugging Face Llama target with the drafter, as
SGLang runs EAGLE-3 with topk 1.

Each verification step, the drafter proposes `num_draft_tokens` tokens one after another from its own hidden states;
the target scores the last accepted token plus the chain in one forward, keeps the longest prefix that matches its
own greedy choices, and adds one token of its own. Reported: tokens per verification step including that bonus
token (SGLang's accept length, pooled over steps and as a mean over prompts with a 95% interval), how often each
draft position is accepted, and whether the output is token for token what plain greedy decoding of the target
gives.

Bookkeeping of one decoding step, with n = len(tokens) (the last token is the target's newest, not yet run by it):
    target KV cache: positions 0..n-2;  target features (aux) known for positions 0..n-2
    drafter extend:  rows for positions not yet in its cache, row p = (aux[p], token p+1) at RoPE position p
    drafting:        row n-2's output predicts token n; draft j is fed back at position n-2+j (training's t + i)
    verification:    target runs tokens[n-1], d_1..d_k; keeps its cache and features up to the last accepted one
    drafter cache:   cropped back to its real rows 0..n-2, since later rows were built on its own guesses

Checked against (read, not copied): sgl-project/sglang@00559ea python/sglang/srt/speculative/eagle_worker.py (target
extend with full hidden-state capture, then a draft extend on the target's states of the accepted tokens after each
verification); sgl-project/SpecForge@a6b6b02 specforge/algorithms/eagle3/model.py (TTT positions t + i, which
decoding must match). SGLang's published accept lengths count the bonus token too.
"""

import inspect
import logging
import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import DynamicCache, GenerationConfig, LlamaForCausalLM

from services.trainer.drafter import Eagle3Drafter, KVCache
from shared import intervals

logger = logging.getLogger(__name__)


@dataclass
class SpeculativeOutput:
    """One prompt decoded speculatively."""

    tokens: list[int]  # the new tokens
    emitted_per_step: list[int]  # tokens added per verification step, the bonus token included
    accepted_per_step: list[int]  # drafts the target accepted per step (before cutting at EOS or the budget)

    @property
    def acceptance_length(self) -> float:
        return sum(self.emitted_per_step) / len(self.emitted_per_step) if self.emitted_per_step else math.nan


@dataclass
class AcceptanceResult:
    mean_accepted_per_step: float  # tokens per target verification step, the bonus token included, pooled
    steps: int  # target verification steps, over all prompts
    tokens: int  # new tokens generated, over all prompts (the first of each comes from the prefill)
    matches_greedy: bool | None  # every prompt's output equals plain greedy decoding of the target (None: not checked)
    prompts: int = 0
    # Per prompt: its tokens per verification step (prompts that stopped before any verification are left out).
    prompt_acceptance_lengths: list[float] = field(default_factory=list)
    # position_acceptance[k]: share of verification steps whose draft k+1 was accepted (so it never rises with k).
    position_acceptance: list[float] = field(default_factory=list)
    speculative_s: float = 0.0  # wall time of the speculative decoding alone (not the greedy reference)

    @property
    def mean_acceptance_length(self) -> float:
        """The mean over prompts of each prompt's acceptance length."""
        return intervals.mean(self.prompt_acceptance_lengths)

    @property
    def acceptance_length_ci95(self) -> tuple[float, float]:
        """A 95% interval of that mean over prompts."""
        return intervals.mean_ci95(self.prompt_acceptance_lengths)


def aux_hidden_state(hidden_states: tuple[Tensor, ...], aux_layer_ids: list[int]) -> Tensor:
    """HF `output_hidden_states` -> [B, T, 3H]. hidden_states[0] is the embedding output, so decoder layer i's
    output is hidden_states[i + 1]; the last entry is post-final-norm (the lm_head input)."""
    return torch.cat([hidden_states[layer_id + 1] for layer_id in aux_layer_ids], dim=-1)


def eos_token_ids(target_model: LlamaForCausalLM) -> list[int]:
    eos = target_model.generation_config.eos_token_id
    if eos is None:
        eos = target_model.config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def cache_argument(model: torch.nn.Module) -> str:
    """The name of the KV cache argument of the model's forward: `cache` from transformers 5.24, `past_key_values`
    before (5.19 is SGLang's pin, which this code meets on a GPU machine). An unknown keyword is swallowed by the
    model's `**kwargs` without an error and the cache stays empty, so the name is read from the signature."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


@torch.no_grad()
def greedy_generate(target_model: LlamaForCausalLM, prompt: list[int], *, max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with transformers' own loop: the reference speculative decoding must reproduce."""
    eos = eos_token_ids(target_model)
    device = target_model.device
    input_ids = torch.tensor([prompt], device=device)
    # An explicit config, so no sampling or repetition settings from the model folder sneak in.
    generation_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
    )
    output = target_model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config
    )
    return output[0, len(prompt) :].tolist()


@torch.no_grad()
def speculative_generate(
    target_model: LlamaForCausalLM,
    drafter: Eagle3Drafter,
    prompt: list[int],
    *,
    num_draft_tokens: int,
    max_new_tokens: int,
) -> SpeculativeOutput:
    """Greedy chain speculative decoding of one prompt."""
    eos = set(eos_token_ids(target_model))
    aux_layer_ids = drafter.config.aux_layer_ids
    device = target_model.device

    cache_keyword = cache_argument(target_model)

    def run_target(token_ids: Tensor) -> tuple[Tensor, Tensor]:
        out = target_model(
            input_ids=token_ids,  # (1, T)
            use_cache=True,
            output_hidden_states=True,
            **{cache_keyword: target_cache},
        )
        return out.logits[0].argmax(-1), aux_hidden_state(out.hidden_states, aux_layer_ids)  # (T,), (1, T, 3H)

    def position_ids(start: int, length: int) -> Tensor:
        return torch.arange(start, start + length, device=device)[None]  # (1, length)

    # Prefill: the target's first token, and its features for every prompt position.
    target_cache = DynamicCache(config=target_model.config)
    prefill_greedy, pending_aux = run_target(torch.tensor([prompt], device=device))
    tokens = [*prompt, int(prefill_greedy[-1])]
    new_tokens, emitted_per_step, accepted_per_step = 1, [], []
    drafter_cache = KVCache()

    while new_tokens < max_new_tokens and tokens[-1] not in eos:
        n = len(tokens)
        # Drafter extend: rows start..n-2 pair the target's features at p with token p+1.
        start = drafter_cache.length
        input_embeds = drafter.embed_input_ids(torch.tensor([tokens[start + 1 : n]], device=device))
        hidden = drafter.backbone(
            input_embeds,
            drafter.project_hidden_states(pending_aux),
            position_ids(start, n - 1 - start),
            cache=drafter_cache,
        )[:, -1:]  # (1, 1, H): row n-2, whose output predicts token n

        # Draft a chain, feeding back the drafter's own hidden state and token (draft j at position n-2+j). The
        # drafts stay on the device until the verification's answer is read: one host sync a step, not one a draft,
        # so that on a GPU the host queues the whole step while the device runs it.
        chain = [torch.tensor([[tokens[-1]]], device=device)]
        for j in range(1, num_draft_tokens + 1):
            draft = drafter.draft_to_target(drafter.compute_logits(hidden).argmax(-1))  # (1, 1) target id
            chain.append(draft)
            if j < num_draft_tokens:
                hidden = drafter.backbone(
                    drafter.embed_input_ids(draft), hidden, position_ids(n - 2 + j, 1), cache=drafter_cache
                )
        drafter_cache.crop(n - 1)  # rows past n-2 were built on guesses

        # Verify: greedy[j] is the target's choice after tokens[n-1], d_1..d_j.
        verify_ids = torch.cat(chain, dim=1)  # (1, 1 + k): tokens[n-1], d_1..d_k
        greedy_on_device, verify_aux = run_target(verify_ids)
        drafts, greedy = verify_ids[0, 1:].tolist(), greedy_on_device.tolist()
        accepted = 0
        while accepted < num_draft_tokens and drafts[accepted] == greedy[accepted]:
            accepted += 1
        target_cache.crop(accepted - num_draft_tokens)  # drop the rejected drafts: keep positions 0..n-1+accepted
        pending_aux = verify_aux[:, : accepted + 1]  # features of positions n-1..n-1+accepted

        emitted = [*drafts[:accepted], greedy[accepted]]
        for position, token in enumerate(emitted):  # stop where greedy decoding would stop
            if token in eos or new_tokens + position + 1 == max_new_tokens:
                emitted = emitted[: position + 1]
                break
        tokens += emitted
        new_tokens += len(emitted)
        emitted_per_step.append(len(emitted))
        accepted_per_step.append(accepted)

    return SpeculativeOutput(tokens[len(prompt) :], emitted_per_step, accepted_per_step)


@torch.no_grad()
def measure_acceptance(
    target_model: LlamaForCausalLM,
    drafter: Eagle3Drafter,
    prompts: list[list[int]],
    *,
    num_draft_tokens: int = 7,
    max_new_tokens: int = 64,
    check_greedy: bool = True,
) -> AcceptanceResult:
    """Speculative decoding of every prompt, checked token for token against plain greedy decoding unless
    `check_greedy` is False (the check decodes every prompt a second time; a caller that only needs the acceptance
    skips it).

    Load the target in float32 for the check to mean anything: in bf16, scoring a chunk of tokens and decoding
    one at a time round differently, so a near-tie can flip and the outputs part without any bug (seen on SmolLM2
    at the second new token).
    """
    if check_greedy and target_model.dtype != torch.float32:
        logger.warning("target in %s: matches_greedy may fail on rounding alone; use float32", target_model.dtype)
    was_training = drafter.training
    drafter.eval()
    target_model.eval()
    steps = step_tokens = tokens = 0
    matches_greedy: bool | None = True if check_greedy else None
    prompt_lengths: list[float] = []
    accepted_at = [0] * num_draft_tokens  # steps whose draft k+1 was accepted
    speculative_s = 0.0
    for index, prompt in enumerate(prompts):
        started = time.perf_counter()
        output = speculative_generate(
            target_model, drafter, prompt, num_draft_tokens=num_draft_tokens, max_new_tokens=max_new_tokens
        )
        speculative_s += time.perf_counter() - started
        generated, emitted_per_step = output.tokens, output.emitted_per_step
        if emitted_per_step:
            prompt_lengths.append(output.acceptance_length)
        for accepted in output.accepted_per_step:
            for k in range(accepted):
                accepted_at[k] += 1
        reference = greedy_generate(target_model, prompt, max_new_tokens=max_new_tokens) if check_greedy else generated
        if generated != reference:
            first = next((i for i, (a, b) in enumerate(zip(generated, reference, strict=False)) if a != b), None)
            logger.warning(
                "prompt %d: speculative output differs from greedy at new token %s (lengths %d vs %d)",
                index,
                first if first is not None else min(len(generated), len(reference)),
                len(generated),
                len(reference),
            )
            matches_greedy = False
        steps += len(emitted_per_step)
        step_tokens += sum(emitted_per_step)
        tokens += len(generated)
    drafter.train(was_training)

    result = AcceptanceResult(
        mean_accepted_per_step=step_tokens / steps if steps else math.nan,
        steps=steps,
        tokens=tokens,
        matches_greedy=matches_greedy,
        prompts=len(prompts),
        prompt_acceptance_lengths=prompt_lengths,
        position_acceptance=[count / steps if steps else math.nan for count in accepted_at],
        speculative_s=speculative_s,
    )
    logger.info(
        "measured acceptance: prompts=%d draft_tokens=%d steps=%d tokens=%d accept_length=%.3f matches_greedy=%s",
        len(prompts),
        num_draft_tokens,
        result.steps,
        result.tokens,
        result.mean_accepted_per_step,
        result.matches_greedy,
    )
    return result

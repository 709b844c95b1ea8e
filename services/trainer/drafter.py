"""The EAGLE-3 drafter in one file: config, small modules, the model, and loading from the target.

EAGLE-3 (Li et al., arXiv 2503.01840) as SGLang serves it (`LlamaForCausalLMEagle3`):

    aux_hidden_state [B,T,3H_t] --fc--> hidden [B,T,H] ----------------------------------------+ residual
    input_ids [B,T] --embed_tokens (the target's, frozen)--> [B,T,H] --input_layernorm--+       |
    hidden -----------------------------------------------------------hidden_norm------+-> cat [B,T,2H]
      -> self_attn (q/k/v_proj read 2H, o_proj writes H) -> + residual
      -> post_attention_layernorm -> mlp -> + residual        = midlayer output [B,T,H]
      -> norm -> lm_head                                       = logits over the draft vocab [B,T,V_draft]
    draft id -> target id: target_id = draft_id + d2t[draft_id]

Notable:
- The midlayer output *before* `norm` is what the next draft step takes as `hidden` (SGLang's draft model returns
  `hidden_states_to_aux`, the pre-norm residual sum, for decoding; SpecForge's `backbone` does the same in training).
- Two attention layouts behind one `backbone`: a growing `KVCache` for decoding (plain causal attention), and a
  `TTTCache` for the training-time test, where unrolled step i at row t attends the causal prefix of step 0 plus
  row t of steps 1..i (`ttt_attention`; the same mask as a matrix is `ttt_attention_mask`).
- The TTT attention has a readable eager reference (`ttt_attention`) and a fast path (`ttt_attention_sdpa`: the
  flash kernel on step 0's causal block, the diagonal terms merged through its logsumexp, no [T, T] scores), picked
  by `DrafterConfig.attn_implementation` through `TTT_ATTENTION_FUNCTIONS`. `compile_backbone` is an opt-in
  torch.compile of the per-step dense work around it.
- Checkpoint names are transformers' Llama names plus EAGLE's: `fc`, `midlayer.*` (with `hidden_norm`), `norm`,
  `lm_head`, buffers `d2t`/`t2d`; `embed_tokens` is the target's and never exported.
- RoPE is plain (no scaling) with the target's theta: the drafter is trained from scratch, so it only has to agree
  with itself at serving time, where SGLang reads `rope_theta` from the exported config.

Symbols used in shape comments: B batch, T query positions, S key positions, H drafter hidden size (= the target's,
since the embedding is shared), H_t target hidden size, nh / nkv query / key-value heads, D head_dim,
V_target / V_draft vocabulary sizes.

Checked against (read, not copied):
- sgl-project/sglang@03d5a77 python/sglang/srt/models/llama_eagle3.py: weight names; q/k/v over
  cat([input_layernorm(embeds), hidden_norm(hidden)]) in that order; residual = hidden; `fc` (3*target_hidden_size
  -> hidden_size, no bias); `norm` returns the pre-norm sum for the next step; `d2t` -> hot_token_id = d2t + arange;
  `t2d` skipped; `lm_head` tied to the embedding when `tie_word_embeddings` (so exports must set it false).
- sgl-project/sglang@0023954 python/sglang/srt/models/llama.py: config fields the layer reads (rope_theta,
  rope_scaling, head_dim, hidden_act == "silu", attention_bias); aux capture is `layers_to_capture = [id + 1]`,
  i.e. the output of decoder layer `id`, our `aux_layer_ids` convention.
- sgl-project/SpecForge@a6b6b02 specforge/modeling/draft/llama3_eagle.py: `LlamaAttention.forward` with
  `cache_hidden` (TTT attention: causal scores against step 0, one extra score per earlier step on the diagonal,
  RoPE positions offset by the step index), `LlamaDecoderLayer`, `compute_logits` = lm_head(norm(h));
  specforge/modeling/target/target_head.py (frozen target lm_head applied to the stored final state).
"""

import functools
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from shared.data.model_assets import language_model_config
from shared.data.vocab import VocabMapping
from shared.errors import ConfigurationError
from shared.storage.sample_format import NUM_AUX_LAYERS

logger = logging.getLogger(__name__)


@dataclass
class DrafterConfig:
    """Everything needed to rebuild the drafter; saved in every checkpoint as `asdict(config)`."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # target vocab: rows of the shared embedding and length of t2d
    draft_vocab_size: int  # rows of lm_head and length of d2t
    target_hidden_size: int
    aux_layer_ids: list[int]  # 0-indexed target decoder layers whose output is captured (HF hidden_states[i + 1])
    attn_implementation: str = "sdpa"  # key of TTT_ATTENTION_FUNCTIONS; both compute the same function
    # Training only: the MLP block's activations (the widest of a step) computed again in backward instead of kept:
    # 0.6x the activations kept per token and unrolled step, for about a sixth more compute; for long sequences.
    recompute_mlp: bool = False

    def __post_init__(self) -> None:
        if self.attn_implementation not in TTT_ATTENTION_FUNCTIONS:
            raise ConfigurationError(
                f"attn_implementation={self.attn_implementation!r}: expected one of {sorted(TTT_ATTENTION_FUNCTIONS)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigurationError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if len(self.aux_layer_ids) != NUM_AUX_LAYERS:
            raise ConfigurationError(f"aux_layer_ids: EAGLE-3 takes {NUM_AUX_LAYERS} layers, got {self.aux_layer_ids}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ConfigurationError(
                f"draft_vocab_size={self.draft_vocab_size} must be in 1..vocab_size={self.vocab_size}"
            )
        if self.hidden_size != self.target_hidden_size:
            # SGLang hands the target's embedding to the drafter, so the drafter's width is the target's.
            raise ConfigurationError(
                f"hidden_size={self.hidden_size} must equal target_hidden_size={self.target_hidden_size}: "
                "the drafter shares the target's token embedding"
            )

    @classmethod
    def from_target_config(
        cls, target_config: dict, *, draft_vocab_size: int, aux_layer_ids: list[int]
    ) -> "DrafterConfig":
        """The drafter's shape from the target's `config.json`: one decoder layer as wide as the target's."""
        text_config = language_model_config(target_config)
        num_layers = text_config["num_hidden_layers"]
        if any(not 0 <= layer_id < num_layers for layer_id in aux_layer_ids):
            raise ConfigurationError(f"aux_layer_ids {aux_layer_ids} outside the target's {num_layers} layers")
        # transformers 5 moved rope_theta into rope_parameters; older configs keep it at the top level.
        rope_theta = (text_config.get("rope_parameters") or {}).get("rope_theta", text_config.get("rope_theta"))
        hidden_size = text_config["hidden_size"]
        num_heads = text_config["num_attention_heads"]
        return cls(
            hidden_size=hidden_size,
            intermediate_size=text_config["intermediate_size"],
            num_attention_heads=num_heads,
            num_key_value_heads=text_config.get("num_key_value_heads", num_heads),
            head_dim=text_config.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=text_config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=text_config.get("max_position_embeddings", 8192),
            vocab_size=text_config["vocab_size"],
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=hidden_size,
            aux_layer_ids=list(aux_layer_ids),
        )


# ----------------------------------------------------------------------------------------------------------
# KV caches: what the midlayer's attention has seen in earlier calls


class KVCache:
    """Keys (RoPE applied) and values of earlier `backbone` calls, for decoding.

    One growing sequence: each call appends its T positions, and a query attends every cached key up to and
    including its own place. After the target verifies a draft chain, `crop` drops the rejected positions.
    """

    def __init__(self) -> None:
        self.key: Tensor | None = None  # [B, nkv, S, D]
        self.value: Tensor | None = None  # [B, nkv, S, D]

    @property
    def length(self) -> int:
        return 0 if self.key is None else self.key.shape[2]

    def update(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Append [B, nkv, T, D] and return everything cached, [B, nkv, S + T, D]."""
        if self.key is None or self.value is None:
            self.key, self.value = key, value
        else:
            self.key = torch.cat([self.key, key], dim=2)
            self.value = torch.cat([self.value, value], dim=2)
        return self.key, self.value

    def crop(self, length: int) -> None:
        """Keep the first `length` positions."""
        assert 0 <= length <= self.length, (length, self.length)
        if self.key is not None and self.value is not None:
            self.key, self.value = self.key[:, :, :length], self.value[:, :, :length]


class TTTCache:
    """Keys and values of the training-time-test steps so far: one [B, nkv, T, D] block per unrolled step,
    all over the same T rows (row t of step i stands for sequence position t + i)."""

    def __init__(self) -> None:
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def update(self, key: Tensor, value: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        self.keys.append(key)
        self.values.append(value)
        return self.keys, self.values


# ----------------------------------------------------------------------------------------------------------
# Attention functions: plain causal attention for decoding, EAGLE-3's TTT attention for training


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """[B, nkv, T, D] -> [B, nkv * n_rep, T, D]: each key-value head serves n_rep query heads (GQA)."""
    if n_rep == 1:
        return x
    B, nkv, T, D = x.shape
    return x[:, :, None].expand(B, nkv, n_rep, T, D).reshape(B, nkv * n_rep, T, D)


def causal_mask(q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """bool [T, S], True = may attend: query j is position kv_len - q_len + j and sees every key up to it."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(diagonal=kv_len - q_len)


def ttt_attention_mask(seq_len: int, num_steps: int, device: torch.device | None = None) -> Tensor:
    """EAGLE-3's training-time-test mask as one matrix: bool [T, num_steps * T], True = may attend.

    Keys are the steps' blocks side by side. Step num_steps - 1 at row t attends the causal prefix of block 0
    (the rows fed by real target features) and row t of every later block (its own earlier draft steps).
    `ttt_attention` computes the same thing without materialising the diagonal blocks.
    """
    blocks = [torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()]
    blocks += [torch.eye(seq_len, dtype=torch.bool, device=device)] * (num_steps - 1)
    return torch.cat(blocks, dim=1)


def ttt_attention(
    query: Tensor, keys: list[Tensor], values: list[Tensor], block_mask: Tensor | None, scale: float
) -> Tensor:
    """Attention of unrolled step i = len(keys) - 1 under EAGLE-3's TTT mask; the eager reference.

    query [B, nh, T, D]; keys[j], values[j] [B, nkv, T, D] are step j's; block_mask bool [.., T, T] over step 0
    (None: causal). Row t scores the allowed step-0 keys with one matmul and its own rows of steps 1..i with one dot
    product each, then takes a single softmax over both (SpecForge's `cache_hidden` path computes the same).
    """
    T = query.shape[2]
    n_rep = query.shape[1] // keys[0].shape[1]
    if block_mask is None:
        block_mask = causal_mask(T, T, query.device)
    scores = query @ repeat_kv(keys[0], n_rep).transpose(-1, -2) * scale  # [B, nh, T, T]
    scores = scores.masked_fill(~block_mask, float("-inf"))
    diagonal = [(query * repeat_kv(key, n_rep)).sum(-1, keepdim=True) * scale for key in keys[1:]]  # i x [B,nh,T,1]
    probs = torch.cat([scores, *diagonal], dim=-1).softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    out = probs[..., :T] @ repeat_kv(values[0], n_rep)  # [B, nh, T, D]
    for j, value in enumerate(values[1:]):
        out = out + probs[..., T + j, None] * repeat_kv(value, n_rep)
    return out


# The fast TTT attention. Step 0's block is plain causal attention, which the flash kernel computes without the
# [T, T] scores; it also returns each row's logsumexp lse0. The i diagonal terms are one score per row each, s_j.
# One softmax over both is then a merge in log space:
#     lse = logsumexp(lse0, s_1..s_i)      out = exp(lse0 - lse) * out0 + sum_j exp(s_j - lse) * v_j
# Backward: the flash kernel's backward recomputes its probabilities as exp(scores - lse) and subtracts
# rowsum(dout * out); handed the merged out and lse, it returns exactly step 0's share of the merged softmax's
# gradient. The diagonal terms and their gradients are small batched fp32 matmuls, G query heads x i steps per row.


def _flash_supports(query: Tensor) -> bool:
    if query.device.type == "cpu":
        return query.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return (
        query.device.type == "cuda"
        and query.dtype in (torch.bfloat16, torch.float16)
        and query.shape[-1] % 8 == 0
        and query.shape[-1] <= 256
    )


# Which fused kernel computes step 0's causal block on CUDA: "cudnn" (cuDNN's fused attention, which has kernels
# written for Hopper; flash where cuDNN is older than 9, the GPU older than Ampere or the heads wider than 128) or
# "flash" (FlashAttention-2, torch's own build). Both return the logsumexp the merge needs and take the merged out and
# lse in backward. On an H100 cuDNN's kernel takes 0.63x flash's time over a 16K or 32K sequence, and the whole step
# 6% less at 1x8192 (docs/benchmarks.md); the benchmark (`bench/vs_specforge.py`, variants `flash_attention` and
# `cudnn_attention`) times either beside the default and checks each kernel's output and gradients in bf16.
CAUSAL_BLOCK_KERNEL = "cudnn"
CAUSAL_BLOCK_KERNELS = ("flash", "cudnn")


def causal_block_kernel(query: Tensor, requested: str | None = None) -> str:
    """The kernel step 0's block runs on for `query`: "cpu", or on CUDA the `requested` one (default
    `CAUSAL_BLOCK_KERNEL`) where the device and cuDNN have it (cuDNN for head dims up to 128, those its backward is
    measured on here; flash takes wider heads)."""
    if not query.is_cuda:
        return "cpu"
    cudnn = (requested or CAUSAL_BLOCK_KERNEL) == "cudnn"
    if cudnn and query.shape[-1] <= 128 and _cudnn_attention_runs_on(query.device):
        return "cudnn"
    return "flash"


@functools.cache
def _cudnn_attention_runs_on(device: torch.device) -> bool:
    """cuDNN 9 or later on an Ampere or later GPU: what its fused attention needs."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return version is not None and version >= 90000 and torch.cuda.get_device_capability(device) >= (8, 0)


def _causal_block_forward(query: Tensor, key: Tensor, value: Tensor, scale: float) -> tuple[Tensor, Tensor, tuple]:
    """Causal attention over one [T, T] block: out [B, nh, T, D], lse fp32 [B, nh, T], and what backward needs.
    key, value [B, nkv, T, D]: each serves G = nh // nkv query heads."""
    kernel = causal_block_kernel(query)
    G = query.shape[1] // key.shape[1]
    if kernel == "cudnn":
        grouped = G == 1 or (CUDNN_GROUPED_HEADS and _cudnn_takes_grouped_heads(query.device))
        if not grouped:
            key, value = repeat_kv(key, G), repeat_kv(value, G)
        out, lse, state = _cudnn_forward(query, key, value, scale)
        return out, lse, (kernel, grouped, *state)
    key, value = repeat_kv(key, G), repeat_kv(value, G)
    if kernel == "flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, True, False, scale=scale
        )
        return out, lse[..., : query.shape[2]], (kernel, cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, True, scale=scale)
    return out, lse, (kernel,)


def _causal_block_backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, scale: float, state: tuple
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of query [B, nh, T, D], key and value [B, nkv, T, D] (a key-value head's G query heads add up)."""
    kernel, *kept = state  # what `_causal_block_forward` returned for backward
    nkv, G = key.shape[1], query.shape[1] // key.shape[1]
    if kernel == "cudnn":
        grouped, *cudnn_state = kept
        if not grouped:
            key, value = repeat_kv(key, G), repeat_kv(value, G)
        grads = _cudnn_backward(grad_out, query, key, value, out, lse, scale, tuple(cudnn_state))
    elif kernel == "flash":
        cum_q, cum_k, max_q, max_k, seed, offset = kept
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out,
            query,
            repeat_kv(key, G),
            repeat_kv(value, G),
            out,
            lse,
            cum_q,
            cum_k,
            max_q,
            max_k,
            0.0,
            True,
            seed,
            offset,
            scale=scale,
        )
    else:
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, repeat_kv(key, G), repeat_kv(value, G), out, lse, 0.0, True, scale=scale
        )
    grad_query, grad_key, grad_value = grads
    return grad_query, _sum_query_groups(grad_key, nkv), _sum_query_groups(grad_value, nkv)


def _sum_query_groups(grad: Tensor, num_kv_heads: int) -> Tensor:
    """[B, nh, T, D] gradients of repeated key-value heads -> [B, nkv, T, D]; as they are where already per kv head."""
    return grad if grad.shape[1] == num_kv_heads else grad.unflatten(1, (num_kv_heads, -1)).sum(2)


def _cudnn_forward(query: Tensor, key: Tensor, value: Tensor, scale: float) -> tuple[Tensor, Tensor, tuple]:
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, True, 0.0, True, False, scale=scale
    )
    # cuDNN's logsumexp may carry a trailing unit dimension: backward gets it back in the shape forward gave
    return out, lse.reshape(query.shape[:3]), (lse.shape, cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, scale: float, state: tuple
) -> tuple[Tensor, Tensor, Tensor]:
    lse_shape, cum_q, cum_k, max_q, max_k, seed, offset = state
    # out and grad_out in one (contiguous) layout: cuDNN's backward wants the two alike
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad_out.contiguous(),
        query,
        key,
        value,
        out.contiguous(),
        lse.contiguous().view(lse_shape),
        seed,
        offset,
        None,
        cum_q,
        cum_k,
        max_q,
        max_k,
        0.0,
        True,
        scale=scale,
    )


# cuDNN's fused attention reads fewer key-value heads than query heads (GQA) as they are, where this torch and cuDNN
# take them: no copies of step 0's keys and values G times in forward and backward, and no sum of the G copies'
# gradients. False repeats them as the flash kernel needs.
CUDNN_GROUPED_HEADS = True


@functools.cache
def _cudnn_takes_grouped_heads(device: torch.device) -> bool:
    """Tried once per device, forward and backward on small bf16 inputs with 2 query heads a key-value head, against
    the same kernel on repeated heads: a torch or cuDNN that refuses the shapes, or computes them otherwise, keeps
    the repeated heads."""
    generator = torch.Generator(device=device).manual_seed(0)
    query, key, value, grad_out = (
        torch.randn(1, heads, 64, 64, device=device, dtype=torch.bfloat16, generator=generator)
        for heads in (4, 2, 2, 4)
    )
    scale = 0.125
    results = []
    try:
        for k, v in ((key, value), (repeat_kv(key, 2), repeat_kv(value, 2))):
            out, lse, state = _cudnn_forward(query, k, v, scale)
            grads = _cudnn_backward(grad_out, query, k, v, out, lse, scale, state)
            results.append((out, *(_sum_query_groups(g.float(), 2) for g in grads[1:]), grads[0]))
    except RuntimeError:
        return False
    return all(
        got.shape == expected.shape and torch.allclose(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
        for got, expected in zip(*results, strict=True)
    )


def _by_kv_head(x: Tensor, num_kv_heads: int) -> Tensor:
    """(B, nh, T, ...) -> (B, nkv, T, G, ...): the G query heads that share one key-value head, per row."""
    return x.unflatten(1, (num_kv_heads, -1)).transpose(2, 3)


def _by_head(x: Tensor) -> Tensor:
    """(B, nkv, T, G, ...) -> (B, nh, T, ...), the inverse of `_by_kv_head`."""
    return x.transpose(2, 3).flatten(1, 2)


def _row_scores(a: Tensor, b: Tensor) -> Tensor:
    """(..., G, D) x (..., i, D) -> (..., G, i): each row's G query heads against its own i keys. Compiled, as a
    product summed over D, which Inductor fuses into one pass over the inputs; eagerly, a batched matmul."""
    if torch.compiler.is_compiling():
        return (a[..., :, None, :] * b[..., None, :, :]).sum(-1)
    return a @ b.transpose(-1, -2)


def _row_mix(p: Tensor, v: Tensor) -> Tensor:
    """(..., G, i) x (..., i, D) -> (..., G, D): each row's weights over its own i values."""
    if torch.compiler.is_compiling():
        return (p[..., :, :, None] * v[..., None, :, :]).sum(-2)
    return p @ v


def _row_outer(p: Tensor, x: Tensor) -> Tensor:
    """(..., G, i) x (..., G, D) -> (..., i, D): summed over each row's G query heads."""
    if torch.compiler.is_compiling():
        return (p[..., :, :, None] * x[..., :, None, :]).sum(-3)
    return p.transpose(-1, -2) @ x


def diagonal_merge_forward(
    query: Tensor, later_keys: Tensor, later_values: Tensor, out0: Tensor, lse0: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """Step 0's flash output and logsumexp merged with the diagonal terms of steps 1..i (the note above), fp32 inside.
    query, out0 (B, nh, T, D); later_keys / later_values (B, nkv, T, i, D); lse0 fp32 (B, nh, T).
    Returns out (B, nh, T, D) in the query's dtype and the merged lse (B, nh, T)."""
    nkv = later_keys.shape[1]
    q = _by_kv_head(query.float(), nkv)  # (B, nkv, T, G, D)
    scores = _row_scores(q, later_keys.float()) * scale  # (B, nkv, T, G, i)
    lse0 = _by_kv_head(lse0, nkv)  # (B, nkv, T, G)
    lse = torch.cat([lse0[..., None], scores], dim=-1).logsumexp(-1)  # (B, nkv, T, G)
    probs = (scores - lse[..., None]).exp()  # (B, nkv, T, G, i)
    merged = _by_kv_head(out0.float(), nkv) * (lse0 - lse).exp()[..., None] + _row_mix(probs, later_values.float())
    return _by_head(merged.to(query.dtype)), _by_head(lse).contiguous()


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
    """The diagonal terms' share of the gradient, softmax backward on each row's i extra scores:
    dv = p^T dout, ds = p * (dout v^T - rowsum(dout * out)), dq += ds k, dk = ds^T q. grad_query0 is the flash
    backward's gradient of the query (B, nh, T, D); returns the query's whole gradient and those of the later keys
    and values (B, nkv, T, i, D), in the query's dtype."""
    nkv = later_keys.shape[1]
    q = _by_kv_head(query.float(), nkv)  # (B, nkv, T, G, D)
    dout = _by_kv_head(grad_out.float(), nkv)  # (B, nkv, T, G, D)
    keys, values = later_keys.float(), later_values.float()  # (B, nkv, T, i, D)
    lse = _by_kv_head(lse, nkv)  # (B, nkv, T, G)
    probs = (_row_scores(q, keys) * scale - lse[..., None]).exp()  # (B, nkv, T, G, i)
    delta = (dout * _by_kv_head(out.float(), nkv)).sum(-1)  # (B, nkv, T, G)
    grad_scores = probs * (_row_scores(dout, values) - delta[..., None])  # (B, nkv, T, G, i)
    grad_q = _by_kv_head(grad_query0.float(), nkv) + _row_mix(grad_scores, keys) * scale  # (B, nkv, T, G, D)
    grad_keys = (_row_outer(grad_scores, q) * scale).to(query.dtype)  # (B, nkv, T, i, D)
    grad_values = _row_outer(probs, dout).to(query.dtype)  # (B, nkv, T, i, D)
    return _by_head(grad_q.to(query.dtype)), grad_keys, grad_values


# Which merges run on CUDA: "triton" (services/trainer/kernels.py: one pass over each row's inputs, its softmax
# in registers), "compiled" (Inductor's kernels from the expressions above: each merge a few fused kernels reading the
# bf16 tensors once, but 4-7x slower than the bytes they move at 8B dims) or "eager" (as written: every fp32 upcast
# and intermediate a tensor of its own, about 2 GB written per unrolled step at 8,192 tokens and 8B dims). The CPU
# runs the merges as written, and the tests trace the compiled forms there and run the Triton kernels in Triton's
# interpreter. `bench/vs_specforge.py` times each (variants `compiled_merges`, `eager_merges`) beside the default.
MERGE_KERNELS_ON_CUDA = "triton"
MERGE_KERNELS = ("triton", "compiled", "eager")


@functools.cache
def _compiled_merges() -> tuple[Callable, Callable]:
    # dynamic: the number of later steps, the batch and the sequence length all vary
    return torch.compile(diagonal_merge_forward, dynamic=True), torch.compile(diagonal_merge_backward, dynamic=True)


def _triton_merges() -> tuple[Callable, Callable]:
    from services.trainer import kernels  # Triton is there only beside a CUDA build of torch

    return kernels.diagonal_merge_forward, kernels.diagonal_merge_backward


def _merges(x: Tensor) -> tuple[Callable, Callable]:
    if x.is_cuda and MERGE_KERNELS_ON_CUDA == "triton":
        return _triton_merges()
    if x.is_cuda and MERGE_KERNELS_ON_CUDA == "compiled":
        return _compiled_merges()
    return diagonal_merge_forward, diagonal_merge_backward


class _TTTAttention(torch.autograd.Function):
    """`ttt_attention` with the default causal block, as flash attention plus a log-space merge (see above).
    The merge runs in fp32 with autocast off, so backward recomputes exactly the probabilities forward used."""

    # ctx is Any: torch's FunctionCtx declares none of the attributes forward keeps on it for backward.
    @staticmethod
    def forward(ctx: Any, scale: float, query: Tensor, *steps: Tensor) -> Tensor:
        with torch.autocast(query.device.type, enabled=False):
            # steps = keys[0..i] then values[0..i], each (B, nkv, T, D); query (B, nh, T, D); G = nh // nkv
            num_steps = len(steps) // 2
            keys, values = steps[:num_steps], steps[num_steps:]
            out, lse, state = _causal_block_forward(query, keys[0], values[0], scale)  # (B, nh, T, D), (B, nh, T)
            lse = lse.contiguous()
            if num_steps > 1:
                merge_forward, _ = _merges(query)
                # row t's own keys and values of steps 1..i: (B, nkv, T, i, D)
                later_keys, later_values = torch.stack(keys[1:], dim=3), torch.stack(values[1:], dim=3)
                out, lse = merge_forward(query, later_keys, later_values, out, lse, scale)
            ctx.scale, ctx.state, ctx.num_steps = scale, state, num_steps
            ctx.save_for_backward(query, out, lse, *steps)
            return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        with torch.autocast(grad_out.device.type, enabled=False):
            query, out, lse, *steps = ctx.saved_tensors
            keys, values = steps[: ctx.num_steps], steps[ctx.num_steps :]
            grad_out = grad_out.contiguous()
            # Step 0's block: the flash backward, handed the merged out and lse (see the note above the class).
            grad_query, grad_key0, grad_value0 = _causal_block_backward(
                grad_out, query, keys[0], values[0], out, lse, ctx.scale, ctx.state
            )
            grad_keys, grad_values = [grad_key0], [grad_value0]  # (B, nkv, T, D) each
            if ctx.num_steps > 1:
                _, merge_backward = _merges(query)
                later_keys, later_values = torch.stack(keys[1:], dim=3), torch.stack(values[1:], dim=3)
                grad_query, grad_later_keys, grad_later_values = merge_backward(
                    grad_out, grad_query, query, out, lse, later_keys, later_values, ctx.scale
                )
                grad_keys += grad_later_keys.unbind(3)
                grad_values += grad_later_values.unbind(3)
            return None, grad_query, *grad_keys, *grad_values


def ttt_attention_sdpa(
    query: Tensor, keys: list[Tensor], values: list[Tensor], block_mask: Tensor | None, scale: float
) -> Tensor:
    """`ttt_attention` without materialising scores: flash attention on step 0's causal block, merged with the
    diagonal terms through its logsumexp. An explicit block mask, or inputs no flash kernel takes (fp32 on CUDA),
    go to the eager reference."""
    if block_mask is not None or not _flash_supports(query):
        return ttt_attention(query, keys, values, block_mask, scale)
    return _TTTAttention.apply(scale, query, *keys, *values)


TTT_ATTENTION_FUNCTIONS = {"eager": ttt_attention, "sdpa": ttt_attention_sdpa}


@torch.compiler.disable
def attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cache: KVCache | TTTCache | None,
    attention_mask: Tensor | None,
    attn_implementation: str,
) -> Tensor:
    """The attention core of one midlayer call: store this call's keys and values, attend. (B, nh, T, D) out.

    Kept out of compiled graphs (`compile_backbone`): the TTT cache grows by one block per unrolled step, so a
    compiled graph around it would recompile at every step; outside it, one graph per side serves every step.
    """
    T, D = query.shape[2:]  # query (B, nh, T, D)
    scale = 1.0 / math.sqrt(D)
    if isinstance(cache, TTTCache):
        keys, values = cache.update(key, value)
        return TTT_ATTENTION_FUNCTIONS[attn_implementation](query, keys, values, attention_mask, scale)
    if cache is not None:
        key, value = cache.update(key, value)  # (B, nkv, S, D)
    mask = attention_mask if attention_mask is not None else causal_mask(T, key.shape[2], query.device)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)


# ----------------------------------------------------------------------------------------------------------
# Small modules


def autocast_input(x: Tensor) -> Tensor:
    """x as the projections reading it take it under autocast: one low-precision copy shared by all of them (autocast
    casts an input once per projection and each projection keeps its own copy for backward), x itself otherwise."""
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Llama's RMSNorm in x's dtype, and the per-row scale rstd (..., 1) it used."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * (x32 * rstd).to(x.dtype)).to(x.dtype), rstd


class _RMSNormFunction(torch.autograd.Function):
    """Llama's RMSNorm (normalise in fp32, since bf16 sums of squares lose too much, then scale), keeping only its
    input and the per-row scale for backward, where the normalised rows are computed again: autograd would keep an
    fp32 copy of the input and of its normalised rows, 8 bytes per element, for each of the four norms of every
    unrolled step. The output has the input's dtype: under autocast every norm feeds a bf16 matmul, which would round
    the fp32 product of the fp32 master weight and the rows to the same bf16 values, one cast kernel later."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        out, rstd = rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd  # (..., H) fp32
        grad_weight = None
        if ctx.needs_input_grad[1]:
            rows = grad_out.float() * normed.to(x.dtype).float()  # the scale multiplied the rounded rows
            grad_weight = rows.reshape(-1, rows.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_normed = grad_out.float() * weight.float()  # (..., H)
            # d/dx of x * rstd(x): rstd * (g - normed * mean(g * normed))
            grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
            grad_x = grad_x.to(x.dtype)
        return grad_x, grad_weight, None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            # Inside `compile_backbone`'s graphs the plain ops: the compiler chooses what backward keeps (it recomputes
            # pointwise work like this by itself), and torch 2.11 traced the Function into a backward that returned
            # zeros on a GPU, for this norm's weight and for every weight before it.
            return rms_norm(x, self.weight, self.eps)[0]
        return _RMSNormFunction.apply(x, self.weight, self.eps)


def rotary_cos_sin(position_ids: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """Plain RoPE tables for position_ids [B, T] -> cos, sin [B, 1, T, D] in fp32.

    Computed per call from the positions (cheap) rather than kept as a buffer, so casting the model to bf16 never
    rounds the frequencies.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim
    inv_freq = theta**-exponent  # [D/2]
    freqs = position_ids[..., None].float() * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, D]
    return emb.cos()[:, None], emb.sin()[:, None]


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v projections read the 2H concatenation of embedding and hidden state."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config  # read at call time, so attn_implementation can be switched on a built model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.q_proj = nn.Linear(2 * config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: Tensor,
        position_ids: Tensor,
        cache: KVCache | TTTCache | None,
        attention_mask: Tensor | None,
    ) -> Tensor:
        B, T, _ = x.shape  # batch, positions, 2H
        x = autocast_input(x)
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, D)
        cos, sin = rotary_cos_sin(position_ids, self.head_dim, self.rope_theta)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        out = attend(q, k, v, cache, attention_mask, self.config.attn_implementation)  # (B, nh, T, D)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)  # (B, T, nh * D)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = autocast_input(x)
        return self.down_proj(_SiluMul.apply(self.gate_proj(x), self.up_proj(x)))


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up keeping gate and up for backward, where silu(gate) is computed again (autograd would also keep
    silu(gate), a third tensor of the MLP's width per unrolled step)."""

    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor]:
        gate, up = ctx.saved_tensors
        gate32, sigmoid = gate.float(), torch.sigmoid(gate.float())
        grad32 = grad_out.float()
        grad_up = grad32 * (gate32 * sigmoid).to(gate.dtype).float()  # as forward multiplied: by the rounded silu
        grad_gate = grad32 * up.float() * sigmoid * (1 + gate32 * (1 - sigmoid))  # d silu(g)/dg
        return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


class Eagle3DecoderLayer(nn.Module):
    """EAGLE-3's `midlayer`: one pre-norm Llama layer whose attention sees the token and the feature."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config  # read at call time, so recompute_mlp can be switched on a built model
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # on the incoming hidden state
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        input_embeds: Tensor,
        hidden_states: Tensor,
        position_ids: Tensor,
        cache: KVCache | TTTCache | None,
        attention_mask: Tensor | None,
        rows: Tensor | None = None,
    ) -> Tensor:
        """rows: the (B x T) flat indices of the rows whose output is used, or None for all. The others skip the
        MLP (their output is then the attention's residual alone): attention is the only place rows meet, and it
        reads its keys and values before the MLP."""
        # The residual stream is the hidden state; the embedding only enters through attention.
        residual = hidden_states
        x = torch.cat([self.input_layernorm(input_embeds), self.hidden_norm(hidden_states)], dim=-1)  # (B, T, 2H)

        # Self Attention
        hidden_states = residual + self.self_attn(x, position_ids, cache, attention_mask)

        # Fully Connected
        if rows is None:
            return hidden_states + self._mlp(hidden_states)
        flat = hidden_states.flatten(0, 1)  # (B * T, H)
        update = self._mlp(flat.index_select(0, rows))  # (n, H)
        dtype = torch.promote_types(flat.dtype, update.dtype)  # as `+` above would promote
        return flat.to(dtype).index_add(0, rows, update.to(dtype)).view(hidden_states.shape)

    def _mlp(self, hidden_states: Tensor) -> Tensor:
        if self.config.recompute_mlp and torch.is_grad_enabled():
            return checkpoint(self._mlp_block, hidden_states, use_reentrant=False)
        return self._mlp_block(hidden_states)

    def _mlp_block(self, hidden_states: Tensor) -> Tensor:
        return self.mlp(self.post_attention_layernorm(hidden_states))


# ----------------------------------------------------------------------------------------------------------
# The drafter


class Eagle3Drafter(nn.Module):
    # Buffers (register_buffer in __init__), declared for the type checker: nn.Module's __getattr__ is Tensor | Module.
    d2t: Tensor
    t2d: Tensor

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        # The target's embedding, loaded by build_drafter and frozen: SGLang serves the drafter with the target's.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(NUM_AUX_LAYERS * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        # d2t: int64 [V_draft]   offset, target_id = draft_id + d2t[draft_id]
        # t2d: bool  [V_target]  True where the target token is in the draft vocabulary
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.backbone_compiled = False  # compile_backbone() sets it
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every trainable weight in one place. Linears ~ N(0, 0.02) (Llama's initializer_range), norms 1; until
        a vocab mapping is set, draft id i is target id i."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=0.02)
        self.d2t.zero_()
        self.t2d.zero_()
        self.t2d[: self.config.draft_vocab_size] = True

    @torch.no_grad()
    def set_vocab_mapping(self, mapping: VocabMapping) -> None:
        if mapping.d2t.shape != self.d2t.shape or mapping.t2d.shape != self.t2d.shape:
            raise ConfigurationError(
                f"vocab mapping d2t {list(mapping.d2t.shape)} / t2d {list(mapping.t2d.shape)} does not fit a drafter "
                f"with draft_vocab_size={self.config.draft_vocab_size}, vocab_size={self.config.vocab_size}"
            )
        self.d2t.copy_(mapping.d2t)
        self.t2d.copy_(mapping.t2d)

    @torch.no_grad()
    def init_from_target(self, target_head_weight: Tensor, target_norm_weight: Tensor) -> None:
        """Start in the target's output space instead of at random: `lm_head` takes the target head's rows of the
        draft tokens, `norm` the target's final norm, and `fc` passes the deepest aux state through (the other two
        start at zero). At step 0 the drafter then reads out roughly what the target's deep layer predicts, and
        training only has to learn the step ahead; a random head must first learn the whole vocabulary.
        Needs the vocab mapping set first. target_head_weight [V_target, H_t], target_norm_weight [H_t]."""
        H = self.config.hidden_size
        target_ids = self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))
        self.lm_head.weight.copy_(target_head_weight[target_ids])  # [V_draft, H]
        self.norm.weight.copy_(target_norm_weight)
        self.fc.weight.zero_()  # [H, 3H_t]: aux blocks low, middle, high
        self.fc.weight[:, 2 * H :].copy_(torch.eye(H))

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids)  # (B, T) -> (B, T, H)

    def project_hidden_states(self, aux_hidden_state: Tensor) -> Tensor:
        assert aux_hidden_state.shape[-1] == self.fc.in_features, (aux_hidden_state.shape, self.fc.in_features)
        if not torch.is_autocast_enabled(aux_hidden_state.device.type):
            aux_hidden_state = aux_hidden_state.to(self.fc.weight.dtype)
        # Under autocast the bf16 states go in as they are: an fp32 copy (4 x 3H_t bytes a token) cast back to bf16
        # would cost two copies, the second kept for backward beside the batch's own.
        return self.fc(aux_hidden_state)  # (B, T, 3H_t) -> (B, T, H)

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
        """One pass of the midlayer: (B, T, H) embeddings and hidden states -> (B, T, H), pre-norm.

        position_ids [B, T] (or [1, T]). cache: None for a standalone causal pass, a `KVCache` to decode
        incrementally, a `TTTCache` to unroll the training-time test. attention_mask: optional bool, True = may
        attend, broadcastable to [B, 1, T, S] (over step 0's block [.., T, T] with a TTTCache); default causal.
        weights: the midlayer's weights to use instead of its own, by name (`backbone_weights`). rows: the flat
        (B x T) indices of the rows whose output is used; the others skip the MLP (`Eagle3DecoderLayer`).
        """
        args = (input_embeds, hidden_states, position_ids, cache, attention_mask, rows)
        if weights:
            return torch.func.functional_call(self.midlayer, weights, args)
        return self.midlayer(*args)

    def backbone_weights(self) -> dict[str, Tensor]:
        """The midlayer's projection weights cast to the autocast dtype once, for all the unrolled steps of one loss,
        when the backbone is compiled and trains under autocast; else none. Eagerly, autocast casts each weight once
        for all the steps and keeps that copy for backward; a compiled graph casts (and keeps) its own copy at every
        call: 0.45 GiB a copy at Llama-3.1-8B dims, six more copies than eagerly. Given the cast ones, every call
        keeps the same copy, and the compiled step's peak is the eager one's (11.66 against 11.67 GiB at 1x2048 on an
        H100, where it had kept 2.6 GiB more)."""
        device_type = self.fc.weight.device.type
        if not (self.backbone_compiled and torch.is_grad_enabled() and torch.is_autocast_enabled(device_type)):
            return {}
        dtype = torch.get_autocast_dtype(device_type)
        return {name: w.to(dtype) for name, w in self.midlayer.named_parameters() if w.dim() == 2}

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        # Training's fused loss computes the same from `norm` and `lm_head.weight` (loss._HeadSoftCrossEntropy).
        return self.lm_head(self.norm(hidden_states))  # (B, T, H) -> (B, T, V_draft)

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def compile_backbone(self, **options: object) -> None:
        """Opt-in torch.compile of the per-step dense work for training: the midlayer (norms, projections, RoPE,
        MLP; `attend` stays eager between its graphs) and the final norm. Checkpoint keys do not change. The first
        steps pay for the compilation. `options` go to torch.compile; dynamic by default, since batches vary in length
        (and the rows given to `compute_logits` shrink with every step)."""
        options = {"dynamic": True, **options}
        self.midlayer.compile(**options)
        self.norm.compile(**options)
        self.backbone_compiled = True


class TargetHead(nn.Module):
    """The target's frozen lm_head. The stored `hidden_state` is already post-final-norm, so no norm here."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [V_target, H_t]

    @classmethod
    def from_pretrained(cls, target_path: Path, *, dtype: torch.dtype = torch.float32) -> "TargetHead":
        config = read_target_config(target_path)
        text_config = language_model_config(config)
        names = list(_HEAD_NAMES)
        if text_config.get("tie_word_embeddings", config.get("tie_word_embeddings", False)):
            names += _EMBEDDING_NAMES  # tied heads are stored once, as the embedding
        weight = _read_tensor(target_path, names)
        assert weight.shape == (text_config["vocab_size"], text_config["hidden_size"]), weight.shape
        return cls(weight.to(dtype))

    def forward(self, hidden_state: Tensor) -> Tensor:
        return F.linear(hidden_state.to(self.weight.dtype), self.weight)  # (B, T, H_t) -> (B, T, V_target)


# ----------------------------------------------------------------------------------------------------------
# Loading from the target's Hugging Face folder (safetensors only, one tensor at a time)

# The target's tensors the drafter reads, by the names a checkpoint may store them under: a causal LM's own, then a
# multimodal model's language model as transformers 5 saves it and as released checkpoints (Llama 4) store it.
_EMBEDDING_NAMES = [
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
]
_HEAD_NAMES = ["lm_head.weight", "language_model.lm_head.weight"]
_FINAL_NORM_NAMES = ["model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight"]


def read_target_config(target_path: Path) -> dict:
    config_path = Path(target_path) / "config.json"
    if not config_path.is_file():
        raise ConfigurationError(f"{config_path}: missing; the target must be a Hugging Face model folder")
    return json.loads(config_path.read_text())


def _read_tensor(target_path: Path, names: list[str]) -> Tensor:
    """The first of `names` found in the target's safetensors files, read without loading the model."""
    target_path = Path(target_path)
    index_path = target_path / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    else:
        weight_map = {}
        for file in sorted(target_path.glob("*.safetensors")):
            with safe_open(file, framework="pt") as handle:
                weight_map.update(dict.fromkeys(handle.keys(), file.name))
    for name in names:
        if name in weight_map:
            with safe_open(target_path / weight_map[name], framework="pt") as handle:
                return handle.get_tensor(name)
    raise ConfigurationError(f"{target_path}: none of {names} in the model's safetensors files")


def load_target_embeddings(target_path: Path) -> Tensor:
    """The target's token embedding [V_target, H_t], read from safetensors without loading the model."""
    return _read_tensor(target_path, _EMBEDDING_NAMES)


def load_target_final_norm(target_path: Path) -> Tensor:
    """The weight of the target's final RMSNorm [H_t], the norm its lm_head reads after."""
    return _read_tensor(target_path, _FINAL_NORM_NAMES)


def build_drafter(
    target_path: Path,
    vocab_mapping: VocabMapping,
    *,
    aux_layer_ids: list[int],
    draft_vocab_size: int | None = None,
    init_from_target: bool = True,
) -> tuple[Eagle3Drafter, TargetHead]:
    """A fresh drafter shaped after the target, with its embedding copied and frozen and d2t/t2d set, plus the
    frozen target head that gives the training targets. `init_from_target`: see `Eagle3Drafter.init_from_target`;
    False keeps the random initialisation."""
    if draft_vocab_size is not None and draft_vocab_size != vocab_mapping.draft_vocab_size:
        raise ConfigurationError(
            f"draft_vocab_size={draft_vocab_size} but the vocab mapping has {vocab_mapping.draft_vocab_size} tokens"
        )
    config = DrafterConfig.from_target_config(
        read_target_config(target_path),
        draft_vocab_size=vocab_mapping.draft_vocab_size,
        aux_layer_ids=aux_layer_ids,
    )
    drafter = Eagle3Drafter(config)
    embeddings = load_target_embeddings(target_path)
    assert embeddings.shape == drafter.embed_tokens.weight.shape, (embeddings.shape, drafter.embed_tokens.weight.shape)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(embeddings)
    drafter.set_vocab_mapping(vocab_mapping)
    target_head = TargetHead.from_pretrained(target_path)
    if init_from_target:
        drafter.init_from_target(target_head.weight, load_target_final_norm(target_path))
    logger.info(
        "drafter for %s: hidden=%d heads=%d/%d vocab=%d draft_vocab=%d aux_layer_ids=%s trainable_params=%d",
        target_path,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.vocab_size,
        config.draft_vocab_size,
        config.aux_layer_ids,
        sum(p.numel() for p in drafter.parameters() if p.requires_grad),
    )
    return drafter, target_head

"""The drafter: shapes from the target, frozen shared embedding, vocab mapping, and the two attention layouts
(decoding KV cache and training-time test) agreeing with the plain full-sequence pass."""

import copy
import math
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaForCausalLM

from services.trainer import drafter as drafter_module
from services.trainer.drafter import (
    DrafterConfig,
    Eagle3Attention,
    Eagle3Drafter,
    KVCache,
    LlamaMLP,
    RMSNorm,
    TargetHead,
    TTTCache,
    autocast_input,
    build_drafter,
    load_target_embeddings,
    read_target_config,
    ttt_attention,
    ttt_attention_sdpa,
)
from shared.data.vocab import VocabMapping, build_vocab_mapping
from shared.errors import ConfigurationError

AUX_LAYER_IDS = [1, 3, 4]  # the default [1, N//2 - 1, N - 4] for the 8-layer tiny target
DRAFT_VOCAB = 128


def small_mapping(target_vocab_size: int, draft_vocab_size: int = DRAFT_VOCAB) -> VocabMapping:
    # Odd ids are "frequent": the draft vocab is a strided subset, so d2t is not all zeros.
    counts = Counter({token: 2 if token % 2 else 1 for token in range(target_vocab_size)})
    return build_vocab_mapping(counts, target_vocab_size=target_vocab_size, draft_vocab_size=draft_vocab_size)


def random_config(**overrides: object) -> DrafterConfig:
    fields = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "vocab_size": 96,
        "draft_vocab_size": 48,
        "target_hidden_size": 64,
        "aux_layer_ids": [1, 3, 4],
    }
    return DrafterConfig(**{**fields, **overrides})  # type: ignore[arg-type]


def random_inputs(config: DrafterConfig, batch: int, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    embeds = torch.randn(batch, seq_len, config.hidden_size, generator=generator)
    hidden = torch.randn(batch, seq_len, config.hidden_size, generator=generator)
    positions = torch.arange(seq_len).expand(batch, seq_len)
    return embeds, hidden, positions


@pytest.fixture(scope="module")
def tiny_drafter(tiny_model_dir: Path) -> tuple[Eagle3Drafter, TargetHead, VocabMapping]:
    target_vocab_size = read_target_config(tiny_model_dir)["vocab_size"]
    mapping = small_mapping(target_vocab_size)
    torch.manual_seed(0)
    drafter, target_head = build_drafter(tiny_model_dir, mapping, aux_layer_ids=AUX_LAYER_IDS)
    return drafter, target_head, mapping


def test_config_follows_the_target(tiny_model_dir: Path) -> None:
    config = DrafterConfig.from_target_config(
        {
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "num_hidden_layers": 30,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},  # transformers 5 layout
            "max_position_embeddings": 8192,
            "vocab_size": 49152,
        },
        draft_vocab_size=32000,
        aux_layer_ids=[1, 14, 26],
    )
    assert (config.hidden_size, config.target_hidden_size, config.head_dim) == (576, 576, 64)
    assert (config.rope_theta, config.draft_vocab_size, config.vocab_size) == (100000.0, 32000, 49152)
    legacy = DrafterConfig.from_target_config(
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_hidden_layers": 8,
            "rope_theta": 500000.0,  # transformers 4 layout
            "vocab_size": 100,
        },
        draft_vocab_size=50,
        aux_layer_ids=AUX_LAYER_IDS,
    )
    assert (legacy.rope_theta, legacy.num_key_value_heads, legacy.head_dim) == (500000.0, 4, 16)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param({"aux_layer_ids": [1, 3]}, "aux_layer_ids", id="two-aux-layers"),
        pytest.param({"draft_vocab_size": 97}, "draft_vocab_size", id="draft-vocab-larger-than-target"),
        pytest.param({"target_hidden_size": 32}, "target_hidden_size", id="embedding-not-shareable"),
        pytest.param({"num_key_value_heads": 3}, "num_key_value_heads", id="heads-not-grouped"),
        pytest.param({"attn_implementation": "flash"}, "attn_implementation", id="unknown-attention"),
    ],
)
def test_config_refuses_shapes_that_cannot_work(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        random_config(**overrides)


def test_build_drafter_refuses_aux_layers_outside_the_target(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigurationError, match="outside the target"):
        build_drafter(
            tiny_model_dir, small_mapping(read_target_config(tiny_model_dir)["vocab_size"]), aux_layer_ids=[1, 3, 8]
        )


def test_shapes(tiny_drafter: tuple[Eagle3Drafter, TargetHead, VocabMapping]) -> None:
    drafter, target_head, _ = tiny_drafter
    config = drafter.config
    B, T, H = 2, 7, config.hidden_size
    input_ids = torch.randint(0, config.vocab_size, (B, T))
    aux = torch.randn(B, T, 3 * config.target_hidden_size, dtype=torch.bfloat16)  # shards store bf16

    embeds = drafter.embed_input_ids(input_ids)
    hidden = drafter.project_hidden_states(aux)
    out = drafter.backbone(embeds, hidden, torch.arange(T).expand(B, T))
    logits = drafter.compute_logits(out)

    assert embeds.shape == hidden.shape == out.shape == (B, T, H)
    assert logits.shape == (B, T, DRAFT_VOCAB)
    assert target_head(torch.randn(B, T, H)).shape == (B, T, config.vocab_size)
    assert drafter.midlayer.self_attn.q_proj.in_features == 2 * H  # attention reads cat(embedding, hidden)
    assert drafter.fc.in_features == 3 * config.target_hidden_size


def test_vocab_mapping_is_set_and_maps_draft_to_target(
    tiny_drafter: tuple[Eagle3Drafter, TargetHead, VocabMapping],
) -> None:
    drafter, _, mapping = tiny_drafter
    assert torch.equal(drafter.d2t, mapping.d2t) and torch.equal(drafter.t2d, mapping.t2d)
    assert drafter.d2t.any(), "the strided draft vocab must give non-zero offsets"
    target_ids = drafter.draft_to_target(torch.arange(DRAFT_VOCAB))
    assert torch.equal(target_ids, mapping.t2d.nonzero().flatten())
    assert {"d2t", "t2d"} <= set(drafter.state_dict())  # buffers travel with every checkpoint


def test_embeddings_are_the_targets_and_stay_frozen(
    tiny_model_dir: Path, tiny_drafter: tuple[Eagle3Drafter, TargetHead, VocabMapping]
) -> None:
    drafter, target_head, _ = tiny_drafter
    with safe_open(tiny_model_dir / "model.safetensors", framework="pt") as handle:
        stored = handle.get_tensor("model.embed_tokens.weight")
    assert torch.equal(load_target_embeddings(tiny_model_dir), stored)
    assert torch.equal(drafter.embed_tokens.weight, stored.float())

    trainable = {name for name, p in drafter.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in trainable and "fc.weight" in trainable
    assert not any(p.requires_grad for p in target_head.parameters())

    before = drafter.embed_tokens.weight.clone()
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    B, T = 2, 5
    out = drafter.backbone(
        drafter.embed_input_ids(torch.randint(0, drafter.config.vocab_size, (B, T))),
        drafter.project_hidden_states(torch.randn(B, T, drafter.fc.in_features)),
        torch.arange(T).expand(B, T),
    )
    drafter.compute_logits(out).logsumexp(-1).mean().backward()
    optimizer.step()
    assert drafter.embed_tokens.weight.grad is None
    assert torch.equal(drafter.embed_tokens.weight, before)
    drafter.zero_grad(set_to_none=True)


def test_target_head_reproduces_the_targets_logits(tiny_model_dir: Path) -> None:
    # The tiny target ties lm_head to the embedding, so the head must come from the embedding.
    target = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    input_ids = torch.randint(0, target.config.vocab_size, (1, 9))
    with torch.no_grad():
        out = target(input_ids, output_hidden_states=True)
    target_head = TargetHead.from_pretrained(tiny_model_dir)
    torch.testing.assert_close(target_head(out.hidden_states[-1]), out.logits)


def test_init_from_target_starts_as_the_logit_lens_of_the_deepest_aux_layer(tiny_model_dir: Path) -> None:
    # With the midlayer's writes to the residual stream silenced, the drafter's step-0 logits are the target head
    # read through the target's final norm at the deepest aux layer, restricted to the draft vocabulary.
    target = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    input_ids = torch.randint(0, target.config.vocab_size, (1, 9))
    with torch.no_grad():
        states = target(input_ids, output_hidden_states=True).hidden_states
    aux = torch.cat([states[i + 1] for i in AUX_LAYER_IDS], dim=-1)  # [1, 9, 3H]
    mapping = small_mapping(target.config.vocab_size)
    drafter, _ = build_drafter(tiny_model_dir, mapping, aux_layer_ids=AUX_LAYER_IDS)
    with torch.no_grad():
        drafter.midlayer.self_attn.o_proj.weight.zero_()
        drafter.midlayer.mlp.down_proj.weight.zero_()
        hidden = drafter.project_hidden_states(aux)
        logits = drafter.compute_logits(
            drafter.backbone(drafter.embed_input_ids(input_ids), hidden, torch.arange(9)[None])
        )
        lens = target.lm_head(target.model.norm(states[AUX_LAYER_IDS[-1] + 1]))  # [1, 9, V_target]
    draft_to_target = torch.arange(mapping.draft_vocab_size) + mapping.d2t
    torch.testing.assert_close(logits, lens[..., draft_to_target])

    torch.manual_seed(0)
    random_start, _ = build_drafter(tiny_model_dir, mapping, aux_layer_ids=AUX_LAYER_IDS, init_from_target=False)
    assert not torch.equal(random_start.lm_head.weight, drafter.lm_head.weight)


def test_kv_cache_decoding_matches_the_full_pass() -> None:
    torch.manual_seed(0)
    config = random_config()
    drafter = Eagle3Drafter(config).eval()
    embeds, hidden, positions = random_inputs(config, batch=2, seq_len=12)
    with torch.no_grad():
        full = drafter.backbone(embeds, hidden, positions)
        cache = KVCache()
        chunks = [
            drafter.backbone(embeds[:, s:e], hidden[:, s:e], positions[:, s:e], cache=cache)
            for s, e in [(0, 5), (5, 6), (6, 7), (7, 10), (10, 12)]
        ]  # a prefill, single tokens, a chunk
        assert cache.length == 12
        torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=1e-5, atol=1e-5)

        # Cropping drops rejected positions: re-feeding them gives the same outputs again.
        cache.crop(7)
        again = drafter.backbone(embeds[:, 7:], hidden[:, 7:], positions[:, 7:], cache=cache)
        torch.testing.assert_close(again, full[:, 7:], rtol=1e-5, atol=1e-5)


def test_ttt_steps_match_drafting_with_the_kv_cache() -> None:
    """Step i at row t under the TTT mask must be what decoding computes when it drafts i tokens after position t."""
    torch.manual_seed(0)
    config = random_config()
    drafter = Eagle3Drafter(config).eval()
    T, steps = 10, 4
    embeds, hidden0, positions = random_inputs(config, batch=1, seq_len=T + steps)
    with torch.no_grad():
        # Training-time test: step i gives row t the input of sequence position t + i (embeds[t + i]).
        cache = TTTCache()
        hidden, ttt_outputs = hidden0[:, :T], []
        for i in range(steps):
            hidden = drafter.backbone(embeds[:, i : i + T], hidden, positions[:, :T] + i, cache=cache)
            ttt_outputs.append(hidden)

        for t in [0, 4, T - 1]:
            decode_cache = KVCache()
            out = drafter.backbone(embeds[:, : t + 1], hidden0[:, : t + 1], positions[:, : t + 1], cache=decode_cache)
            drafted = [out[:, -1:]]
            for i in range(1, steps):
                drafted.append(
                    drafter.backbone(
                        embeds[:, t + i : t + i + 1], drafted[-1], positions[:, t : t + 1] + i, cache=decode_cache
                    )
                )
            for i in range(steps):
                torch.testing.assert_close(ttt_outputs[i][:, t : t + 1], drafted[i], rtol=1e-5, atol=1e-5)


def ttt_attention_outputs_and_grads(
    attention: object, steps: int, *, dtype: torch.dtype, device: str, seed: int = 0
) -> list[torch.Tensor]:
    """Output and gradients of step `steps - 1`'s TTT attention (GQA, 2 query heads per kv head) on random inputs."""
    generator = torch.Generator(device).manual_seed(seed)
    B, nh, nkv, T, D = 2, 8, 4, 37, 16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device).to(dtype).requires_grad_()

    query = randn(B, nh, T, D)
    keys = [randn(B, nkv, T, D) for _ in range(steps)]
    values = [randn(B, nkv, T, D) for _ in range(steps)]
    out = attention(query, keys, values, None, 1 / math.sqrt(D))  # type: ignore[operator]
    grad_out = torch.randn(out.shape, generator=generator, device=device).to(dtype)
    return [out, *torch.autograd.grad(out, [query, *keys, *values], grad_out)]


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_sdpa_ttt_attention_matches_eager_forward_and_backward(steps: int) -> None:
    # CPU fp32 takes the same path as CUDA bf16 (flash kernel for step 0's block, log-space merge, custom backward).
    eager = ttt_attention_outputs_and_grads(ttt_attention, steps, dtype=torch.float32, device="cpu")
    fast = ttt_attention_outputs_and_grads(ttt_attention_sdpa, steps, dtype=torch.float32, device="cpu")
    for reference, got in zip(eager, fast, strict=True):
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("steps", [2, 5])
def test_sdpa_ttt_attention_with_traced_merges_matches_eager(steps: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Compiled (CUDA with MERGE_KERNELS_ON_CUDA "compiled"), the diagonal merges take their summed-product forms
    # (`_row_scores`, ...); aot_eager traces them the same way on the CPU, without a C++ compiler.
    compiled = tuple(
        torch.compile(merge, backend="aot_eager", dynamic=True)
        for merge in (drafter_module.diagonal_merge_forward, drafter_module.diagonal_merge_backward)
    )
    calls: list[int] = []

    def traced_merges(x: torch.Tensor) -> tuple:
        calls.append(1)
        return compiled

    monkeypatch.setattr(drafter_module, "_merges", traced_merges)
    eager = ttt_attention_outputs_and_grads(ttt_attention, steps, dtype=torch.float32, device="cpu")
    fast = ttt_attention_outputs_and_grads(ttt_attention_sdpa, steps, dtype=torch.float32, device="cpu")
    assert len(calls) == 2  # forward and backward both took the traced merges
    for reference, got in zip(eager, fast, strict=True):
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash kernel path needs a CUDA GPU")
@pytest.mark.parametrize("kernel", drafter_module.CAUSAL_BLOCK_KERNELS)
@pytest.mark.parametrize("merge_kernels", drafter_module.MERGE_KERNELS)
@pytest.mark.parametrize("steps", [1, 3])
def test_sdpa_ttt_attention_matches_eager_on_cuda_in_bf16(
    steps: int, merge_kernels: str, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(drafter_module, "MERGE_KERNELS_ON_CUDA", merge_kernels)
    monkeypatch.setattr(drafter_module, "CAUSAL_BLOCK_KERNEL", kernel)
    reference = ttt_attention_outputs_and_grads(ttt_attention, steps, dtype=torch.float32, device="cuda")
    for attention in (ttt_attention, ttt_attention_sdpa):
        got = ttt_attention_outputs_and_grads(attention, steps, dtype=torch.bfloat16, device="cuda")
        for expected, actual in zip(reference, got, strict=True):
            relative_error = (actual.float() - expected).norm() / expected.norm()
            assert relative_error < 2e-2, (attention.__name__, relative_error)


def backbone_and_head_parameters(drafter: Eagle3Drafter) -> list[torch.nn.Parameter]:
    return [*drafter.midlayer.parameters(), *drafter.norm.parameters(), *drafter.lm_head.parameters()]


def test_ttt_unroll_is_the_same_with_either_attention_implementation() -> None:
    torch.manual_seed(0)
    config = random_config()
    drafter = Eagle3Drafter(config)
    embeds, hidden0, positions = random_inputs(config, batch=2, seq_len=9)

    def unroll(attn_implementation: str) -> list[torch.Tensor]:
        config.attn_implementation = attn_implementation  # read at call time
        cache, hidden, outputs = TTTCache(), hidden0, []
        for i in range(4):
            hidden = drafter.backbone(embeds, hidden, positions + i, cache=cache)
            outputs.append(hidden)
        loss = sum(drafter.compute_logits(h).logsumexp(-1).mean() for h in outputs)
        grads = torch.autograd.grad(loss, backbone_and_head_parameters(drafter))
        return [torch.stack(outputs), *grads]

    for reference, got in zip(unroll("eager"), unroll("sdpa"), strict=True):
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # torch.compile takes most of a minute on 2 cores
@pytest.mark.parametrize(
    ("device", "backend"),
    [
        # aot_eager traces the graphs (and the breaks around `attend`) without a C++ or GPU compiler.
        ("cpu", "aot_eager"),
        # Inductor's generated kernels on the GPU, in fp32 so that the gradients must match closely.
        pytest.param("cuda", "inductor", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
    ],
)
def test_compiled_backbone_matches_eager_and_compiles_once_for_all_steps(device: str, backend: str) -> None:
    torch.manual_seed(0)
    config = random_config()
    embeds, hidden0, positions = (t.to(device) for t in random_inputs(config, batch=2, seq_len=9))

    def unroll(drafter: Eagle3Drafter) -> list[torch.Tensor]:
        cache, hidden, outputs = TTTCache(), hidden0, []
        for i in range(4):
            hidden = drafter.backbone(embeds, hidden, positions + i, cache=cache)
            outputs.append(drafter.compute_logits(hidden[:, : 9 - i]))  # rows shrink per step, as in ttt_loss
        loss = sum(logits.logsumexp(-1).mean() for logits in outputs)
        grads = torch.autograd.grad(loss, backbone_and_head_parameters(drafter))
        return [*outputs, *grads]

    drafter = Eagle3Drafter(config).to(device)
    reference = unroll(drafter)
    torch._dynamo.reset()
    drafter.compile_backbone(backend=backend)
    got = unroll(drafter)
    unroll(drafter)  # a second batch reuses every graph
    for expected, actual in zip(reference, got, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert "midlayer.self_attn.q_proj.weight" in drafter.state_dict()  # checkpoint keys unchanged
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------------------
# The memory-lean pieces against plain autograd: the same values and gradients, fewer tensors kept for backward


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference: Llama's RMSNorm as plain tensor ops, autograd keeping what it keeps; the output in the input's
    dtype, as with Llama's weights in the model's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(x.dtype)).to(x.dtype)


def outputs_and_grads(function: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = function(*leaves)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out))
    return [out.detach(), *(leaf.grad for leaf in leaves)]


@contextmanager
def kept_for_backward() -> Iterator[dict[int, int]]:
    """The storages autograd keeps for backward while inside: data pointer -> bytes (each storage once)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield storages


def saved_bytes(function: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for backward of `function(*inputs)`."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    with kept_for_backward() as storages:
        function(*leaves)
    return sum(storages.values())


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_llamas_and_keeps_less(dtype: torch.dtype, device: str) -> None:
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 17, 64, generator=generator) * 3).to(device=device, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(64, generator=generator)).to(device)
    norm = RMSNorm(64, eps=1e-6).to(device)

    ours = outputs_and_grads(lambda x, w: _apply_norm(norm, x, w), x, weight)
    reference = outputs_and_grads(lambda x, w: llama_rms_norm(x, w, 1e-6), x, weight)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for a, b in zip(ours, reference, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tolerance)
    # The input and one scale per row, against the reference's fp32 input and normalised rows.
    assert saved_bytes(lambda x, w: _apply_norm(norm, x, w), x, weight) < saved_bytes(
        lambda x, w: llama_rms_norm(x, w, 1e-6), x, weight
    )


def _apply_norm(norm: RMSNorm, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The module's forward with `weight` in place of its parameter (so that its gradient lands on a leaf we hold)."""
    return torch.func.functional_call(norm, {"weight": weight}, (x,))


def mlp_outputs_and_grads(mlp: LlamaMLP, function: Callable, x: torch.Tensor, bf16: bool) -> list[torch.Tensor]:
    """Output, input gradient and weight gradients, under bf16 autocast or in fp32."""
    mlp.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        results = outputs_and_grads(function, x)
    return [r.float() for r in results] + [p.grad.clone() for p in mlp.parameters()]


@pytest.mark.parametrize("device", DEVICES)
def test_mlp_matches_plain_autograd_and_keeps_less(device: str) -> None:
    config = random_config()
    mlp = LlamaMLP(config).to(device)
    x = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(1)).to(device)

    def plain(x: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))

    truth = mlp_outputs_and_grads(mlp, plain, x, bf16=False)
    for ours, reference in zip(mlp_outputs_and_grads(mlp, mlp, x, bf16=False), truth, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    # Under bf16 autocast both round; ours (silu's derivative in fp32, one rounding) is no further from the fp32
    # values than plain autograd (bf16 at every step) is.
    lean = mlp_outputs_and_grads(mlp, mlp, x, bf16=True)
    rounded = mlp_outputs_and_grads(mlp, plain, x, bf16=True)
    for ours, reference, exact in zip(lean, rounded, truth, strict=True):
        assert (ours - exact).norm() <= 1.1 * (reference - exact).norm() + 1e-6

    # silu(gate) is not kept, and under autocast one bf16 copy of x serves both projections.
    assert saved_bytes(mlp, x) < saved_bytes(plain, x)
    with torch.autocast(device, dtype=torch.bfloat16):
        assert saved_bytes(lambda x: mlp(x + 0), x) < saved_bytes(lambda x: plain(x + 0), x)


def test_attention_projections_share_one_autocast_copy_of_their_input() -> None:
    config = random_config()
    attention = Eagle3Attention(config)
    x = torch.randn(1, 8, 2 * config.hidden_size)
    position_ids = torch.arange(8)[None]

    # x + 0: not a leaf, as in the model (the concatenation of two norms); autocast caches the casts of leaves only.
    def projections_only(x: torch.Tensor) -> torch.Tensor:
        x = autocast_input(x + 0)
        return attention.q_proj(x).sum() + attention.k_proj(x).sum() + attention.v_proj(x).sum()

    def casting_per_projection(x: torch.Tensor) -> torch.Tensor:
        x = x + 0
        return attention.q_proj(x).sum() + attention.k_proj(x).sum() + attention.v_proj(x).sum()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert saved_bytes(projections_only, x) < saved_bytes(casting_per_projection, x)
        torch.testing.assert_close(projections_only(x), casting_per_projection(x))
        out = attention(x, position_ids, None, None)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 8, config.hidden_size)


@pytest.mark.parametrize("compiled", [False, True])
def test_recomputed_mlp_gives_the_same_unroll_and_keeps_less(compiled: bool) -> None:
    torch.manual_seed(0)
    config = random_config()
    embeds, hidden0, positions = random_inputs(config, batch=2, seq_len=9)
    drafter = Eagle3Drafter(config)
    saved: list[int] = []

    def unroll() -> list[torch.Tensor]:
        cache, hidden, outputs = TTTCache(), hidden0, []
        with kept_for_backward() as storages:
            for i in range(4):
                hidden = drafter.backbone(embeds, hidden, positions + i, cache=cache)
                outputs.append(drafter.compute_logits(hidden[:, : 9 - i]))
        weights = {p.untyped_storage().data_ptr() for p in drafter.parameters()}
        saved.append(sum(n for pointer, n in storages.items() if pointer not in weights))
        loss = sum(logits.logsumexp(-1).mean() for logits in outputs)
        return [*outputs, *torch.autograd.grad(loss, backbone_and_head_parameters(drafter))]

    reference = unroll()
    if compiled:
        torch._dynamo.reset()
        drafter.compile_backbone(backend="aot_eager")
    drafter.config.recompute_mlp = True
    got = unroll()
    for expected, actual in zip(reference, got, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    if not compiled:  # compiled graphs keep what their partitioner chooses
        assert saved[1] < 0.8 * saved[0], saved
    torch._dynamo.reset()


@pytest.mark.slow  # torch.compile takes most of a minute on 2 cores
@pytest.mark.parametrize("recompute_mlp", [False, True], ids=["kept", "recompute_mlp"])
@pytest.mark.parametrize(
    ("device", "backend"),
    [
        ("cpu", "aot_eager"),
        pytest.param("cuda", "inductor", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
    ],
)
def test_compiled_backbone_under_autocast_shares_one_cast_of_its_weights(
    device: str, backend: str, recompute_mlp: bool
) -> None:
    from bench.trainer_throughput import random_models
    from bench.vs_specforge import DIMS, random_batch
    from services.trainer.loss import ttt_loss

    drafter, target_head = (model.to(device) for model in random_models(DIMS["tiny"]))
    drafter.config.recompute_mlp = recompute_mlp
    batch = random_batch(DIMS["tiny"], 2, 24, seed=1).to(device)

    def loss_and_grads(model: Eagle3Drafter) -> list[torch.Tensor]:
        params = [p for p in model.parameters() if p.requires_grad]
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = ttt_loss(model, target_head, batch).loss
        return [loss, *torch.autograd.grad(loss, params)]

    assert drafter.backbone_weights() == {}  # eager: autocast's own cache shares one cast
    reference = loss_and_grads(drafter)
    torch._dynamo.reset()
    compiled = copy.deepcopy(drafter)
    compiled.compile_backbone(backend=backend)
    with torch.autocast(device, dtype=torch.bfloat16):
        cast = compiled.backbone_weights()
    midlayer_matrices = {name for name, w in compiled.midlayer.named_parameters() if w.dim() == 2}
    assert set(cast) == midlayer_matrices and all(w.dtype == torch.bfloat16 for w in cast.values())
    assert compiled.backbone_weights() == {}  # outside autocast: nothing to cast
    got = loss_and_grads(compiled)
    for actual, expected in zip(got, reference, strict=True):
        # Both accumulate the steps' gradients of a weight on its one bf16 copy, as eager autocast does.
        assert (actual.float() - expected.float()).norm() <= 2e-2 * expected.float().norm() + 1e-6
    torch._dynamo.reset()


def test_under_autocast_the_projection_keeps_the_batchs_own_bf16_states_for_backward(
    tiny_drafter: tuple[Eagle3Drafter, TargetHead, VocabMapping],
) -> None:
    drafter = copy.deepcopy(tiny_drafter[0])
    aux = torch.randn(2, 16, drafter.fc.in_features).to(torch.bfloat16)
    saved: list[torch.Tensor] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        projected = drafter.project_hidden_states(aux)
    # The weight's gradient reads the input: the batch's tensor itself, not an fp32 copy cast back to bf16.
    assert any(t.data_ptr() == aux.data_ptr() for t in saved), [(t.shape, t.dtype) for t in saved]
    assert not any(t.shape == aux.shape and t.data_ptr() != aux.data_ptr() for t in saved)
    expected = torch.nn.functional.linear(aux, drafter.fc.weight.to(torch.bfloat16))
    torch.testing.assert_close(projected, expected, rtol=0, atol=0)
    # Without autocast (the CPU's fp32 training) the states are cast to the weight's dtype.
    assert drafter.project_hidden_states(aux).dtype == torch.float32

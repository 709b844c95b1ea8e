"""SGLang export: exactly the weight names its EAGLE-3 loader reads, the config fields it reads, and a round trip
back into the drafter that changes nothing."""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig

from services.trainer.drafter import Eagle3Drafter, build_drafter, load_target_embeddings, read_target_config
from services.trainer.export import SGLANG_KEYS, ExportError, export_sglang, load_sglang_export
from shared.data.vocab import build_vocab_mapping

AUX_LAYER_IDS = [1, 3, 4]
DRAFT_VOCAB = 128


def bf16_drafter(model_dir: Path) -> Eagle3Drafter:
    """A drafter whose weights survive bf16 export bit for bit, with a non-trivial vocab mapping."""
    vocab_size = read_target_config(model_dir)["vocab_size"]
    counts = Counter({token: 2 if token % 2 else 1 for token in range(vocab_size)})
    mapping = build_vocab_mapping(counts, target_vocab_size=vocab_size, draft_vocab_size=DRAFT_VOCAB)
    torch.manual_seed(0)
    drafter, _ = build_drafter(model_dir, mapping, aux_layer_ids=AUX_LAYER_IDS)
    with torch.no_grad():
        for parameter in drafter.parameters():
            if parameter.requires_grad:  # norms start at exactly 1; make every weight carry information
                parameter.add_(0.1 * torch.randn_like(parameter))
            parameter.copy_(parameter.to(torch.bfloat16).float())
    return drafter


def outputs(drafter: Eagle3Drafter) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    B, T = 2, 9
    input_ids = torch.randint(0, drafter.config.vocab_size, (B, T), generator=generator)
    aux = torch.randn(B, T, 3 * drafter.config.target_hidden_size, generator=generator)
    with torch.no_grad():
        hidden = drafter.backbone(
            drafter.embed_input_ids(input_ids), drafter.project_hidden_states(aux), torch.arange(T).expand(B, T)
        )
        logits = drafter.compute_logits(hidden)
    return logits, drafter.draft_to_target(logits.argmax(-1))


def test_export_writes_exactly_the_weight_names_sglang_reads(tiny_model_dir: Path, tmp_path: Path) -> None:
    drafter = bf16_drafter(tiny_model_dir)
    config = drafter.config
    export_dir = export_sglang(drafter, tmp_path / "export")
    with safe_open(export_dir / "model.safetensors", framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (safe_open is no dict)
    assert set(tensors) == SGLANG_KEYS
    assert not any("embed" in name for name in tensors)  # SGLang reuses the target's embedding
    H, H_t = config.hidden_size, config.target_hidden_size
    q_out, kv_out = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    expected_shapes = {
        "fc.weight": (H, 3 * H_t),
        "midlayer.self_attn.q_proj.weight": (q_out, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv_out, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv_out, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q_out),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "lm_head.weight": (DRAFT_VOCAB, H),
        "d2t": (DRAFT_VOCAB,),
        "t2d": (config.vocab_size,),
    }
    for name, shape in expected_shapes.items():
        assert tuple(tensors[name].shape) == shape, name
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert all(t.dtype == torch.bfloat16 for name, t in tensors.items() if name not in {"d2t", "t2d"})
    # SGLang's hot token ids are d2t + arange: they must be the target ids that t2d marks.
    assert torch.equal(tensors["d2t"] + torch.arange(DRAFT_VOCAB), tensors["t2d"].nonzero().flatten())


def test_export_config_has_the_fields_sglang_reads(tiny_model_dir: Path, tmp_path: Path) -> None:
    drafter = bf16_drafter(tiny_model_dir)
    config = drafter.config
    export_dir = export_sglang(drafter, tmp_path / "export")
    written = json.loads((export_dir / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLMEagle3"]
    assert written["model_type"] == "llama" and written["num_hidden_layers"] == 1
    assert written["tie_word_embeddings"] is False  # true would make SGLang's lm_head the embedding
    assert written["torch_dtype"] == "bfloat16" and written["hidden_act"] == "silu"
    assert written["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": AUX_LAYER_IDS, "use_aux_hidden_state": True}
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "vocab_size",
        "draft_vocab_size",
        "target_hidden_size",
    ):
        assert written[field] == getattr(config, field), field

    # SGLang parses the folder with transformers' AutoConfig; the extra fields must survive that.
    parsed = AutoConfig.from_pretrained(export_dir)
    assert parsed.model_type == "llama" and parsed.architectures == ["LlamaForCausalLMEagle3"]
    assert parsed.draft_vocab_size == DRAFT_VOCAB and parsed.target_hidden_size == config.target_hidden_size
    assert parsed.eagle_config["eagle_aux_hidden_state_layer_ids"] == AUX_LAYER_IDS
    assert parsed.rope_parameters["rope_theta"] == config.rope_theta  # not the 10000 default
    assert parsed.tie_word_embeddings is False


def test_export_then_reload_gives_identical_outputs(tiny_model_dir: Path, tmp_path: Path) -> None:
    drafter = bf16_drafter(tiny_model_dir).eval()
    export_dir = export_sglang(drafter, tmp_path / "export")
    for reloaded in (
        load_sglang_export(export_dir, target_path=tiny_model_dir),
        load_sglang_export(export_dir, embeddings=load_target_embeddings(tiny_model_dir)),
    ):
        assert reloaded.config == drafter.config
        reloaded_state = reloaded.state_dict()
        for name, tensor in drafter.state_dict().items():
            assert torch.equal(reloaded_state[name], tensor), name
        for before, after in zip(outputs(drafter), outputs(reloaded.eval()), strict=True):
            assert torch.equal(before, after)


def test_export_refuses_weight_names_sglang_would_drop(tiny_model_dir: Path, tmp_path: Path) -> None:
    drafter = bf16_drafter(tiny_model_dir)
    drafter.extra_norm = nn.LayerNorm(4)  # e.g. an experiment's module SGLang would silently ignore
    with pytest.raises(ExportError, match=r"unexpected \['extra_norm.bias', 'extra_norm.weight'\]"):
        export_sglang(drafter, tmp_path / "export")
    assert not (tmp_path / "export" / "model.safetensors").exists()


def test_loading_an_export_with_a_missing_weight_fails(tiny_model_dir: Path, tmp_path: Path) -> None:
    export_dir = export_sglang(bf16_drafter(tiny_model_dir), tmp_path / "export")
    tensors = load_file(export_dir / "model.safetensors")
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, export_dir / "model.safetensors")
    with pytest.raises(ExportError, match=r"missing \['midlayer.hidden_norm.weight'\]"):
        load_sglang_export(export_dir, target_path=tiny_model_dir)
    with pytest.raises(ExportError, match="exactly one"):
        load_sglang_export(export_dir)

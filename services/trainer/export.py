"""Export the drafter as an SGLang EAGLE-3 draft model folder, and load such a folder back.

SGLang serves the folder with `--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR`. Its loader
(`LlamaForCausalLMEagle3.load_weights`) maps `midlayer.*`, `fc`, `norm` and `lm_head` onto its modules, turns `d2t`
into hot token ids and skips `t2d`; a name it does not know is dropped without an error, and a missing one stays at
its initial value. So the key set is checked before anything is written.

config.json carries what SGLang reads: the Llama layer shape (`LlamaConfig` fields its decoder layer uses,
`hidden_act` "silu" being the only one its MLP accepts), `draft_vocab_size` and `target_hidden_size` (the model),
`tie_word_embeddings: false` (true would make lm_head the embedding), and
`eagle_config.eagle_aux_hidden_state_layer_ids` (the model runner arms the target's capture of layers `id + 1`,
i.e. the outputs of our 0-indexed `aux_layer_ids`). RoPE theta is written both ways (`rope_theta` for
transformers 4 readers, `rope_parameters` for transformers 5) so neither falls back to 10000.

Checked against (read, not copied): sgl-project/sglang@03d5a77 python/sglang/srt/models/llama_eagle3.py,
sgl-project/sglang@0023954 python/sglang/srt/models/llama.py, sgl-project/sglang@0005834
python/sglang/srt/model_executor/model_runner.py (`eagle_config["eagle_aux_hidden_state_layer_ids"]`,
`use_aux_hidden_state`), sgl-project/SpecForge@a6b6b02 specforge/export/to_sglang.py (`_REQUIRED_SERVING_KEYS`,
embedding dropped) and configs/llama3-8B-eagle3.json.
"""

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from services.trainer.drafter import DrafterConfig, Eagle3Drafter, load_target_embeddings
from shared.errors import ConfigurationError

logger = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
EXPORT_DTYPE = torch.bfloat16
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

# Exactly the names SGLang's EAGLE-3 loader consumes; the shared embedding stays with the target.
SGLANG_KEYS = frozenset(
    {
        "fc.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.self_attn.k_proj.weight",
        "midlayer.self_attn.v_proj.weight",
        "midlayer.self_attn.o_proj.weight",
        "midlayer.post_attention_layernorm.weight",
        "midlayer.mlp.gate_proj.weight",
        "midlayer.mlp.up_proj.weight",
        "midlayer.mlp.down_proj.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    }
)
_NOT_EXPORTED = frozenset({"embed_tokens.weight"})


class ExportError(ConfigurationError):
    """An export folder that SGLang would load wrongly, or that cannot be loaded back."""


def sglang_config(config: DrafterConfig) -> dict:
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
    }


def drafter_config_from_sglang(config: dict, *, source: Path) -> DrafterConfig:
    if config.get("architectures") != [ARCHITECTURE] or config.get("num_hidden_layers") != 1:
        raise ExportError(
            f"{source}: architectures={config.get('architectures')} num_hidden_layers="
            f"{config.get('num_hidden_layers')}; expected [{ARCHITECTURE!r}] with one layer"
        )
    try:
        return DrafterConfig(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            head_dim=config["head_dim"],
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=config["rope_theta"],
            max_position_embeddings=config["max_position_embeddings"],
            vocab_size=config["vocab_size"],
            draft_vocab_size=config["draft_vocab_size"],
            target_hidden_size=config.get("target_hidden_size", config["hidden_size"]),
            aux_layer_ids=config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        )
    except KeyError as exc:
        raise ExportError(f"{source}: {CONFIG_FILE} has no field {exc}") from exc


def _check_keys(keys: set[str], *, source: str) -> None:
    missing, unexpected = SGLANG_KEYS - keys, keys - SGLANG_KEYS
    if missing or unexpected:
        raise ExportError(
            f"{source}: weight names differ from what SGLang's EAGLE-3 loader reads: "
            f"missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )


def export_sglang(drafter: Eagle3Drafter, out_dir: Path) -> Path:
    """Write config.json and model.safetensors (bf16 weights, int64 d2t, bool t2d; no embedding) into out_dir."""
    out_dir = Path(out_dir)
    state = {name: tensor for name, tensor in drafter.state_dict().items() if name not in _NOT_EXPORTED}
    _check_keys(set(state), source=f"drafter state_dict for {out_dir}")
    tensors = {
        name: tensor.detach().to("cpu", EXPORT_DTYPE if tensor.is_floating_point() else tensor.dtype).contiguous()
        for name, tensor in state.items()
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(sglang_config(drafter.config), indent=2) + "\n")
    logger.info(
        "exported drafter to %s: %d tensors, %d bytes, aux_layer_ids=%s",
        out_dir,
        len(tensors),
        (out_dir / WEIGHTS_FILE).stat().st_size,
        drafter.config.aux_layer_ids,
    )
    return out_dir


def load_sglang_export(
    export_dir: Path, *, target_path: Path | None = None, embeddings: Tensor | None = None
) -> Eagle3Drafter:
    """An fp32 drafter from an export folder; the embedding comes from `embeddings` [V_target, H] or is read from
    the target folder, since exports leave it out."""
    export_dir = Path(export_dir)
    if (target_path is None) == (embeddings is None):
        raise ExportError(f"{export_dir}: pass exactly one of target_path or embeddings for the shared embedding")
    config = drafter_config_from_sglang(json.loads((export_dir / CONFIG_FILE).read_text()), source=export_dir)
    state = load_file(export_dir / WEIGHTS_FILE)
    _check_keys(set(state), source=str(export_dir / WEIGHTS_FILE))
    if embeddings is None:
        assert target_path is not None
        embeddings = load_target_embeddings(target_path)
    drafter = Eagle3Drafter(config)
    state = {name: t.float() if t.is_floating_point() else t for name, t in state.items()}
    drafter.load_state_dict({**state, "embed_tokens.weight": embeddings.float()}, strict=True)
    return drafter

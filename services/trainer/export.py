"""Export the drafter for the serving engines: an SGLang EAGLE-3 draft model folder (and load it back), or a
vLLM one in the speculators format.

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

vLLM (`export_vllm`) serves EAGLE-3 drafters in the speculators format (`vllm serve TARGET --speculative-config
'{"model": DIR, "method": "eagle3", ...}'`): config.json is a speculators `Eagle3SpeculatorConfig`
(`speculators_model_type` "eagle3", the decoder layer as a Llama `transformer_layer_config`, `speculators_config`
naming the verifier) and the weights are the SGLang ones with `midlayer.` renamed `layers.0.`. Its aux layer ids
count like HF `hidden_states` indices (vLLM captures a layer's *input*), so they are our `aux_layer_ids` + 1.
Checked against (read, not copied) the speculators 0.9.0 wheel: speculators/models/eagle3/{config,core}.py,
speculators/convert/eagle/eagle3_converter.py (`midlayer.` -> `layers.0.`), speculators/models/utils.py
(`resolve_target_layer_ids`: ids within [0, num_layers], num_layers being the final state).
"""

import json
import logging
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from services.trainer.checkpoint import drafter_from_checkpoint, load_checkpoint
from services.trainer.drafter import DrafterConfig, Eagle3Drafter, load_target_embeddings
from shared.errors import ConfigurationError
from shared.settings import Settings
from shared.storage.objects import open_storage

logger = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
EXPORT_DTYPE = torch.bfloat16
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PROVENANCE_FILE = "eagle3_provenance.json"  # shared/provenance.py: what the drafter was trained on

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


SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format this writes (tests load it with that package)
VLLM_ARCHITECTURE = "Eagle3Speculator"


def speculators_config(config: DrafterConfig, *, verifier: str, num_draft_tokens: int) -> dict:
    """config.json of a speculators-format EAGLE-3 drafter, for vLLM."""
    layer = {key: value for key, value in sglang_config(config).items() if key not in ("eagle_config", "architectures")}
    layer.pop("draft_vocab_size")
    layer.pop("target_hidden_size")
    return {
        "architectures": [VLLM_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_draft_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "norm_before_residual": False,  # the residual is the un-normed hidden state (drafter.py)
        # vLLM captures the input of layer id, i.e. the output of our decoder layer id - 1.
        "eagle_aux_hidden_state_layer_ids": [layer_id + 1 for layer_id in config.aux_layer_ids],
        "torch_dtype": "bfloat16",
    }


def export_vllm(drafter: Eagle3Drafter, out_dir: Path, *, verifier: str, num_draft_tokens: int = 3) -> Path:
    """Write a speculators-format folder (config.json, model.safetensors) that vLLM serves as an EAGLE-3 drafter.
    `verifier` is the target as vLLM will be given it (a local folder or a hub id)."""
    out_dir = Path(out_dir)
    state = {name: tensor for name, tensor in drafter.state_dict().items() if name not in _NOT_EXPORTED}
    _check_keys(set(state), source=f"drafter state_dict for {out_dir}")
    tensors = {
        name.replace("midlayer.", "layers.0.", 1): tensor.detach()
        .to("cpu", EXPORT_DTYPE if tensor.is_floating_point() else tensor.dtype)
        .contiguous()
        for name, tensor in state.items()
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    config = speculators_config(drafter.config, verifier=verifier, num_draft_tokens=num_draft_tokens)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    logger.info("exported drafter for vLLM (speculators format) to %s, verifier %s", out_dir, verifier)
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


def export_checkpoint(
    ref: str,
    out_dir: Path,
    *,
    settings: Settings,
    model_path: str | None = None,
    engine: Literal["sglang", "vllm"] = "sglang",
    verifier: str | None = None,
) -> Path:
    """A draft model folder for `engine` from a checkpoint; `verifier` (vLLM) defaults to the target's folder."""
    storage = open_storage(settings.storage_url, settings)
    checkpoint = load_checkpoint(ref, storage)
    drafter, _ = drafter_from_checkpoint(checkpoint, model_path=model_path)
    if engine == "vllm":
        out = export_vllm(drafter, out_dir, verifier=verifier or str(model_path or checkpoint.model_path))
    else:
        out = export_sglang(drafter, out_dir)
    # The data it was trained on travels with it; the engines ignore a file they do not know.
    record = {
        "job_id": checkpoint.job_id,
        "step": checkpoint.step,
        "checkpoint": checkpoint.source,
        "provenance": checkpoint.provenance,
    }
    (out / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return out

"""Exports loaded by the serving engines' own model classes, on CPU with the tiny target: SpecForge's EAGLE-3 draft
model (the class SGLang-format folders are trained and converted with) and speculators' `Eagle3DraftModel` (the
format vLLM serves) give the same draft logits as our drafter for the same inputs.

What is exercised: each package's model class, its config parsing of our config.json, its weight names and shapes
(a key we write that it does not know, or one it needs that we do not write, fails the test), its own loading of
the target's embedding, and its forward (SpecForge: `embed_input_ids`, `project_hidden_states`, `backbone`,
`compute_logits`; speculators: `forward` with one TTT step, logits taken at its `lm_head`). What is not: SGLang's
and vLLM's serving loaders themselves, which need a GPU build of those engines.

Two loader quirks under transformers 5.24 (both packages pin older releases), worked around here and not in the
export: SpecForge's `from_pretrained` leaves the RoPE cache buffers uninitialised, so its model is built with its
constructor and loaded with `load_state_dict`; speculators' `load_verifier_weights` only fills an embedding that is
NaN, which `from_pretrained`'s uninitialised memory need not be, so the embedding is loaded with overwrite.
"""

import json
from pathlib import Path

import specforge.modeling.draft.llama3_eagle as specforge_draft  # installed by `make install` (Makefile)
import speculators.models.eagle3 as speculators_eagle3
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig

from services.trainer.drafter import Eagle3Drafter
from services.trainer.export import export_sglang, export_vllm
from tests.trainer.test_export import bf16_drafter

B, T = 2, 9


def draft_inputs(drafter: Eagle3Drafter, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, drafter.config.vocab_size, (batch, T), generator=generator)
    aux = torch.randn(batch, T, 3 * drafter.config.target_hidden_size, generator=generator)  # (B, T, 3H_t)
    return input_ids, aux, torch.arange(T).expand(batch, T)


@torch.no_grad()
def our_logits(
    drafter: Eagle3Drafter, input_ids: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    hidden = drafter.backbone(drafter.embed_input_ids(input_ids), drafter.project_hidden_states(aux), positions)
    return drafter.compute_logits(hidden)  # (B, T, V_draft)


def test_sglang_export_gives_our_logits_in_specforges_draft_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    drafter = bf16_drafter(tiny_model_dir).eval()  # bf16-exact weights: the export changes nothing
    export_dir = export_sglang(drafter, tmp_path / "sglang")

    model = specforge_draft.LlamaForCausalLMEagle3(LlamaConfig.from_pretrained(export_dir), attention_backend="sdpa")
    weights = {
        name: t.float() if t.is_floating_point() else t
        for name, t in load_file(export_dir / "model.safetensors").items()
    }
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert (missing, unexpected) == (["embed_tokens.weight"], [])  # the embedding is the target's, shared
    model.load_embedding(str(tiny_model_dir))  # SpecForge's own loader of the target's embedding
    model.eval()
    assert model.draft_vocab_size == drafter.config.draft_vocab_size and model.norm_output

    input_ids, aux, positions = draft_inputs(drafter, B)
    mask = specforge_draft.prepare_decoder_attention_mask(torch.ones(B, T, dtype=torch.bool), (B, T), aux, 0)
    with torch.no_grad():
        hidden = model.backbone(
            model.embed_input_ids(input_ids), model.project_hidden_states(aux), None, mask, positions, use_cache=False
        )
        theirs = model.compute_logits(hidden)
    torch.testing.assert_close(theirs, our_logits(drafter, input_ids, aux, positions), rtol=1.6e-2, atol=1e-5)
    assert torch.equal(model.d2t, drafter.d2t) and torch.equal(model.t2d, drafter.t2d)


def test_vllm_export_loads_in_speculators_with_our_logits(tiny_model_dir: Path, tmp_path: Path) -> None:
    drafter = bf16_drafter(tiny_model_dir).eval()
    export_dir = export_vllm(drafter, tmp_path / "vllm", verifier=str(tiny_model_dir), num_draft_tokens=4)

    model = speculators_eagle3.Eagle3DraftModel.from_pretrained(export_dir, dtype=torch.float32)
    model._load_verifier_weights(overwrite_embed_tokens=True)  # the target's embedding, by speculators' own loader
    model.eval()
    config = model.config
    assert config.speculators_config.verifier.name_or_path == str(tiny_model_dir)
    assert config.speculators_config.proposal_methods[0].speculative_tokens == 4
    # vLLM captures the input of these layers: the outputs of our aux layers.
    assert config.eagle_aux_hidden_state_layer_ids == [i + 1 for i in drafter.config.aux_layer_ids]
    assert config.draft_vocab_size == drafter.config.draft_vocab_size and not config.norm_before_residual
    assert torch.equal(model.d2t, drafter.d2t) and torch.equal(model.t2d, drafter.t2d)

    input_ids, aux, positions = draft_inputs(drafter, 1)  # speculators packs sequences into one row
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda module, inputs, output: logits.append(output))
    with torch.no_grad():
        model(
            hidden_states=aux,
            input_ids=input_ids,
            document_ids=torch.zeros(1, T, dtype=torch.long),
            position_ids=positions,
            ttt_steps=1,
        )
    hook.remove()
    assert len(logits) == 1
    torch.testing.assert_close(logits[0], our_logits(drafter, input_ids, aux, positions), rtol=1.6e-2, atol=1e-5)


def test_vllm_export_writes_layers_0_names_and_no_embedding(tiny_model_dir: Path, tmp_path: Path) -> None:
    drafter = bf16_drafter(tiny_model_dir)
    export_dir = export_vllm(drafter, tmp_path / "vllm", verifier="org/target")
    names = set(load_file(export_dir / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)
    assert not any("embed" in n for n in names)
    config = json.loads((export_dir / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["transformer_layer_config"]["num_hidden_layers"] == 1

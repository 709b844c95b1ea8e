"""Ground truth for captured states: the served model run by transformers in fp32, one prompt at a time.

Index convention (transformers `LlamaModel.forward`): `output_hidden_states[0]` is the embedding output and
`[i + 1]` the output of decoder layer i; transformers 5 stores the post-norm state in the last entry, so the raw
output of the last layer N - 1 is not available here and is never a candidate in the nearest-layer check.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from tests.reference_checks import relative_error

# bf16 (server) against fp32 (here): under 1% for aux layers, 2-5% for the final state on real models
# (docs/architecture.md, "Aux layer ids"); random tiny models stay well inside these.
AUX_REL_TOL = 0.05
FINAL_REL_TOL = 0.08


@dataclass
class HFStates:
    layers: list[torch.Tensor]  # layers[i]: fp32 [L, H], output of decoder layer i, for i in [0, N - 2]
    final: torch.Tensor  # fp32 [L, H], post-final-norm (the input to lm_head)


class HFReference:
    def __init__(self, model_path: Path, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.device = device  # cpu by default: on a GPU host the server under test holds most of the GPU
        model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
        self.model = model.to(self.device).eval()

    @torch.no_grad()
    def states(self, prompt: list[int]) -> HFStates:
        output = self.model.base_model(torch.tensor([prompt], device=self.device), output_hidden_states=True)
        hidden_states = output.hidden_states  # N + 1 entries of (1, L, H)
        layers = [h[0].float().cpu() for h in hidden_states[1:-1]]  # decoder layers 0 .. N - 2
        return HFStates(layers=layers, final=output.last_hidden_state[0].float().cpu())


def layer_errors(captured: torch.Tensor, states: HFStates) -> list[float]:
    """Relative L2 error of one captured [L, H] slice against every decoder layer's output."""
    return [relative_error(captured, layer) for layer in states.layers]


def assert_aux_matches_layers(aux_hidden_state: torch.Tensor, states: HFStates, aux_layer_ids: list[int]) -> None:
    """Each slice equals its own layer and matches it better than every other layer (an off-by-one cannot pass)."""
    width = states.final.shape[-1]
    for slot, layer_id in enumerate(aux_layer_ids):
        captured = aux_hidden_state[:, slot * width : (slot + 1) * width]
        errors = layer_errors(captured, states)
        assert errors[layer_id] < AUX_REL_TOL, f"slot {slot} vs layer {layer_id}: relative error {errors[layer_id]:.4f}"
        best = min(range(len(errors)), key=errors.__getitem__)
        assert best == layer_id, (
            f"slot {slot} matches layer {best} better than the requested layer {layer_id}: "
            + ", ".join(f"{i}:{e:.4f}" for i, e in enumerate(errors))
        )


def assert_final_is_post_norm(hidden_state: torch.Tensor, states: HFStates) -> None:
    error = relative_error(hidden_state, states.final)
    assert error < FINAL_REL_TOL, f"final state vs post-norm state: relative error {error:.4f}"
    nearest_layer = min(layer_errors(hidden_state, states))
    assert error < nearest_layer, f"final state is nearer a decoder layer output ({nearest_layer:.4f}) than post-norm"

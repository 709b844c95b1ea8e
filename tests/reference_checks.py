"""Checks of stored hidden states against the Hugging Face model's own `output_hidden_states`."""

from pathlib import Path

import torch


class HFReference:
    """The target computed by transformers in fp32, unbatched: the ground truth for captured states."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()

    @torch.no_grad()
    def hidden_states(self, input_ids: list[int]) -> tuple[torch.Tensor, ...]:
        out = self.model.model(torch.tensor([input_ids]), output_hidden_states=True)
        # hidden_states[i + 1] is decoder layer i's output; last_hidden_state is post-norm.
        return (*out.hidden_states[:-1], out.last_hidden_state)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def assert_matches_layers(
    record: dict[str, torch.Tensor], reference: HFReference, aux_layer_ids: list[int], *, tolerance: float = 0.05
) -> None:
    """Each slice equals its own layer (bf16 tolerance) and matches it better than every other layer,
    so an off-by-one layer id cannot pass."""
    states = reference.hidden_states(record["input_ids"].tolist())
    layers, final = states[1:-1], states[-1]  # layers[i]: output of decoder layer i
    hidden = record["hidden_state"][0]
    aux = record["aux_hidden_state"][0]
    width = hidden.shape[-1]
    assert relative_error(hidden, final[0]) < tolerance, "final state is not the post-norm state"
    for slot, layer_id in enumerate(aux_layer_ids):
        captured = aux[:, slot * width : (slot + 1) * width]
        errors = [relative_error(captured, layer[0]) for layer in layers]
        assert errors[layer_id] < tolerance, f"aux slot {slot}: error {errors[layer_id]:.4f} vs layer {layer_id}"
        best = min(range(len(errors)), key=errors.__getitem__)
        assert best == layer_id, f"aux slot {slot} matches layer {best} better than layer {layer_id}: {errors}"

"""Captured hidden states against a recomputation of the same input ids: the comparison an audit runs on every
sample it re-checks, and the golden check (services/inference/sglang/golden_check.py) on a server's captures.

Relative error, defined once here for every comparison: for `actual` and `expected` of [L, H] (L tokens, hidden size
H), in float32,
    e_t = ||actual_t - expected_t|| / ||expected_t||     (L2 norm over the H values of token t)
    relative error = sqrt(mean of e_t^2 over the tokens compared)
so a zeroed state scores exactly 1.0, and an unrelated state of the same size about 1.4.

Per token rather than ||A - E|| / ||E|| over the whole [L, H]: in a trained model the first token's state (the
attention sink) grows huge from the middle layers on (SmolLM2-135M layer 14: norm 25,000 against a median of 160 for
the other tokens) and would outweigh every other token together. The states of another chat prompt (the same
template, so the same first 24 tokens) score 0.02-0.05 on that layer over the whole tensor, inside any usable
tolerance; per token they score 0.49-0.85. Per token, every token weighs the same, wherever a model puts its large
activations.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from shared.capture.protocol import CapturedStates
from shared.capture.tolerances import DEFAULT_TOLERANCES, Tolerances
from shared.storage.dtypes import StorageDtype
from shared.storage.sample_format import NUM_AUX_LAYERS

_TINY = torch.finfo(torch.float32).tiny  # keeps an all-zero expected token from dividing by zero


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The relative error of `actual` against `expected`, both [L, H] of any float dtype, as the module docstring
    defines it."""
    expected = expected.float()
    per_token = (actual.float() - expected).norm(dim=-1) / expected.norm(dim=-1).clamp_min(_TINY)  # [L]
    return float(per_token.square().mean().sqrt())


def nearest(actual: torch.Tensor, candidates: Sequence[torch.Tensor]) -> int | None:
    """The index of the candidate [L, H] that `actual` [L, H] is nearest to, judged without the first token; None
    where that cannot be told: a single token, or candidates equally near (a zeroed state is 1.0 from all).

    The first token's state barely changes between middle layers (SmolLM2-135M: under 0.1% between layers 13, 14
    and 15, less than bf16 rounding; 1% between 14 and 26, whose other tokens differ by 94%), so it says nothing of
    which layer a state is and would only add rounding noise. Its error counts in relative_error all the same."""
    if actual.shape[0] < 2:
        return None
    errors = [relative_error(actual[1:], candidate[1:]) for candidate in candidates]
    best = min(errors)
    return errors.index(best) if errors.count(best) == 1 else None


@dataclass(frozen=True)
class SampleComparison:
    """One stored sample against its recomputation. Errors are NaN and nearest slices None where not compared."""

    storage_dtype: StorageDtype
    aux_layer_ids: list[int]
    aux_errors: list[float]  # each stored aux slice against the same slice recomputed
    final_error: float
    # Per stored aux slice, the recomputed slice it is nearest to: its own index when in place.
    nearest_aux: list[int | None]
    reasons: list[str]  # why it failed, each naming the layer or field and the numbers; empty when it passed

    @property
    def passed(self) -> bool:
        return not self.reasons


def compare_sample(
    stored: Mapping[str, torch.Tensor],
    recomputed: CapturedStates,
    aux_layer_ids: Sequence[int],
    storage_dtype: StorageDtype,
    *,
    recomputed_input_ids: Sequence[int] | None = None,
    tolerances: Tolerances = DEFAULT_TOLERANCES,
) -> SampleComparison:
    """Compare a stored sample, as `decode_sample` returns it (input_ids [L], aux_hidden_state [1, L, 3H],
    hidden_state [1, L, H]), with a recomputation of its input ids (aux [L, 3H] in the order of `aux_layer_ids`,
    hidden [L, H]; `recomputed_input_ids` where the backend reports the ids it ran). The numbers are float32 on the
    stored tensors' device."""
    if len(aux_layer_ids) != NUM_AUX_LAYERS:
        raise ValueError(f"aux_layer_ids {list(aux_layer_ids)}: expected {NUM_AUX_LAYERS} layer ids")
    layer_ids = list(aux_layer_ids)
    reasons = _shape_reasons(stored, recomputed, recomputed_input_ids)
    if reasons:
        return SampleComparison(
            storage_dtype,
            layer_ids,
            aux_errors=[math.nan] * NUM_AUX_LAYERS,
            final_error=math.nan,
            nearest_aux=[None] * NUM_AUX_LAYERS,
            reasons=reasons,
        )
    if recomputed_input_ids is not None:
        reasons += _input_id_reasons(stored["input_ids"].tolist(), list(recomputed_input_ids))

    limits = tolerances.for_dtype(storage_dtype)
    device = stored["hidden_state"].device
    stored_final = stored["hidden_state"][0].float()  # [L, H]
    recomputed_final = recomputed.hidden_state.to(device=device, dtype=torch.float32)
    hidden_size = stored_final.shape[-1]
    stored_aux = stored["aux_hidden_state"][0].float().split(hidden_size, dim=-1)  # 3 x [L, H]
    recomputed_aux = recomputed.aux_hidden_state.to(device=device, dtype=torch.float32).split(hidden_size, dim=-1)

    aux_errors: list[float] = []
    aux_finite: list[bool] = []
    for slot, (stored_slice, recomputed_slice) in enumerate(zip(stored_aux, recomputed_aux, strict=True)):
        name = f"aux layer {slot} (model layer {layer_ids[slot]})"
        non_finite = _non_finite_reasons(name, stored_slice, recomputed_slice)
        error = math.nan if non_finite else relative_error(stored_slice, recomputed_slice)
        reasons += non_finite + _over_tolerance(name, error, limits.aux, storage_dtype)
        aux_errors.append(error)
        aux_finite.append(not non_finite)
    # Every stored slice against every recomputed one: a swap of two layers is caught even where their errors
    # happen to stay inside the tolerance.
    nearest_aux = [
        nearest(stored_slice, recomputed_aux) if finite and all(aux_finite) else None
        for stored_slice, finite in zip(stored_aux, aux_finite, strict=True)
    ]
    reasons += _placement_reasons(nearest_aux, layer_ids)
    non_finite = _non_finite_reasons("final state", stored_final, recomputed_final)
    final_error = math.nan if non_finite else relative_error(stored_final, recomputed_final)
    reasons += non_finite + _over_tolerance("final state", final_error, limits.final, storage_dtype)
    return SampleComparison(storage_dtype, layer_ids, aux_errors, final_error, nearest_aux, reasons)


def _shape_reasons(
    stored: Mapping[str, torch.Tensor], recomputed: CapturedStates, recomputed_input_ids: Sequence[int] | None
) -> list[str]:
    """What keeps the tensors from being compared token by token: lengths or widths that differ."""
    length = stored["input_ids"].shape[0]
    hidden_size = stored["hidden_state"].shape[-1]
    expected_shapes = {
        "stored aux_hidden_state": (stored["aux_hidden_state"], (1, length, NUM_AUX_LAYERS * hidden_size)),
        "stored hidden_state": (stored["hidden_state"], (1, length, hidden_size)),
        "recomputed aux_hidden_state": (recomputed.aux_hidden_state, (length, NUM_AUX_LAYERS * hidden_size)),
        "recomputed hidden_state": (recomputed.hidden_state, (length, hidden_size)),
    }
    reasons = []
    for name, (tensor, shape) in expected_shapes.items():
        if tensor.dim() == len(shape) and tensor.shape[-2] != length:
            reasons.append(f"length: {name} has {tensor.shape[-2]} tokens, the stored input ids {length}")
        elif tuple(tensor.shape) != shape:
            reasons.append(f"shape: {name} is {list(tensor.shape)}, expected {list(shape)} (hidden size {hidden_size})")
    if recomputed_input_ids is not None and len(recomputed_input_ids) != length:
        reasons.append(f"length: the recomputed input ids are {len(recomputed_input_ids)}, the stored ones {length}")
    return reasons


def _input_id_reasons(stored_ids: list[int], recomputed_ids: list[int]) -> list[str]:
    differing = [position for position, (a, b) in enumerate(zip(stored_ids, recomputed_ids, strict=True)) if a != b]
    if not differing:
        return []
    first = differing[0]
    return [
        f"input ids: {len(differing)} of {len(stored_ids)} differ from the recomputation's, first at position {first} "
        f"(stored {stored_ids[first]}, recomputed {recomputed_ids[first]})"
    ]


def _non_finite_reasons(name: str, stored: torch.Tensor, recomputed: torch.Tensor) -> list[str]:
    """A reason for each side holding NaN or inf: its relative error would mean nothing."""
    reasons = []
    for side, tensor in (("stored", stored), ("recomputed", recomputed)):
        bad = int(tensor.isfinite().logical_not().sum())
        if bad:
            reasons.append(f"{name}: {bad} non-finite value{'s' if bad > 1 else ''} (NaN or inf) in the {side} state")
    return reasons


def _over_tolerance(name: str, error: float, tolerance: float, storage_dtype: StorageDtype) -> list[str]:
    if error > tolerance:  # NaN, where nothing was compared, is not
        return [f"{name}: relative error {error:.3f} > {tolerance:g} ({storage_dtype})"]
    return []


def _placement_reasons(nearest_aux: list[int | None], aux_layer_ids: list[int]) -> list[str]:
    reasons = []
    for slot, found in enumerate(nearest_aux):
        if found is None or found == slot:
            continue
        if nearest_aux[found] == slot:  # two slices that traded places: one reason for the pair
            if slot < found:
                reasons.append(
                    f"aux slices {slot} and {found} (model layers {aux_layer_ids[slot]} and {aux_layer_ids[found]}) "
                    f"are swapped: slice {slot} is nearest recomputed slice {found}, slice {found} nearest slice {slot}"
                )
        else:
            reasons.append(
                f"aux slice {slot} (model layer {aux_layer_ids[slot]}) is nearest recomputed slice {found} "
                f"(model layer {aux_layer_ids[found]}), not its own"
            )
    return reasons

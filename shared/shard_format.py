"""The per-sample hidden-state file: SpecForge's offline record, so its trainer can read ours.

A `torch.save` dict, true length L, no padding:
    input_ids         int64 [L]
    loss_mask         int64 [L]
    aux_hidden_state  bf16  [1, L, 3H]   three aux layers concatenated, low to high
    hidden_state      bf16  [1, L, H]    post-final-norm state (the input to lm_head)
"""

import io

import torch

from shared.capture_protocol import NUM_AUX_LAYERS
from shared.errors import Eagle3Error

HIDDEN_DTYPE = torch.bfloat16


class InvalidCapture(Eagle3Error):
    """Captured tensors that must not be committed; `field` names the tensor."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def validate_capture(
    aux_hidden_state: torch.Tensor, hidden_state: torch.Tensor, *, num_tokens: int, hidden_size: int
) -> None:
    """Checks before commit. aux: [L, 3H], hidden: [L, H] as received from the inference server."""
    for field, tensor, width in (
        ("aux_hidden_state", aux_hidden_state, NUM_AUX_LAYERS * hidden_size),
        ("hidden_state", hidden_state, hidden_size),
    ):
        if tensor.dtype != HIDDEN_DTYPE:
            raise InvalidCapture(field, f"dtype {tensor.dtype}, expected {HIDDEN_DTYPE}")
        if tensor.dim() != 2:
            raise InvalidCapture(field, f"shape {tuple(tensor.shape)}, expected [rows, {width}]")
        rows, columns = tensor.shape
        if rows != num_tokens:  # a radix-cache hit or chunked prefill returns fewer rows
            raise InvalidCapture(field, f"{rows} rows for a prompt of {num_tokens} tokens")
        if columns != width:
            raise InvalidCapture(field, f"width {columns}, expected {width} (hidden size {hidden_size})")
        # One pass over the tensor: min and max propagate NaN and inf, and are both 0 only for all zeros.
        low, high = torch.aminmax(tensor)
        if not (torch.isfinite(low) and torch.isfinite(high)):
            bad = int((~torch.isfinite(tensor)).sum())
            raise InvalidCapture(field, f"{bad} non-finite values (NaN or inf)")
        if low == 0 and high == 0:
            raise InvalidCapture(field, "all zeros")


def encode_sample(
    input_ids: list[int], loss_mask: list[int], aux_hidden_state: torch.Tensor, hidden_state: torch.Tensor
) -> bytes:
    record = {
        "input_ids": torch.tensor(input_ids, dtype=torch.long),  # [L]
        "loss_mask": torch.tensor(loss_mask, dtype=torch.long),  # [L]
        "aux_hidden_state": aux_hidden_state.contiguous().unsqueeze(0),  # [L, 3H] -> [1, L, 3H]
        "hidden_state": hidden_state.contiguous().unsqueeze(0),  # [L, H] -> [1, L, H]
    }
    buffer = io.BytesIO()
    torch.save(record, buffer)
    return buffer.getvalue()


def decode_sample(data: bytes) -> dict[str, torch.Tensor]:
    # weights_only: the files live in a shared bucket, and a pickle from it must never run code.
    record = torch.load(io.BytesIO(data), weights_only=True)
    missing = {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"} - set(record)
    if missing:
        raise InvalidCapture(", ".join(sorted(missing)), "missing from the sample record")
    return record

"""The per-sample hidden-state file: SpecForge's offline record, so its trainer can read ours.

A `torch.save` dict, true length L, no padding. Two storage dtypes, chosen per job (`JobSpec.storage_dtype`):

bfloat16 (the default; SpecForge reads it as is):
    input_ids         int64 [L]
    loss_mask         int64 [L]
    aux_hidden_state  bf16  [1, L, 3H]   three aux layers concatenated, low to high
    hidden_state      bf16  [1, L, H]    post-final-norm state (the input to lm_head)

fp8_e4m3 (about half the bytes; only this project's trainer decodes it):
    input_ids               int64          [L]
    loss_mask               int64          [L]
    aux_hidden_state        float8_e4m3fn  [1, L, 3H]   value / scale, rounded to e4m3
    aux_hidden_state_scale  float32        [1, L, 3]    one scale per token and aux layer
    hidden_state            float8_e4m3fn  [1, L, H]
    hidden_state_scale      float32        [1, L, 1]    one scale per token
where scale = max |value| over that token's layer / 448 (e4m3's largest finite value), so every token uses the
whole fp8 range. `decode_sample` returns bf16 tensors either way: value = float(fp8) * scale, rounded to bf16.
"""

import io
from typing import IO, Protocol, cast

import numpy as np
import torch
from typing_extensions import Buffer

from shared.errors import Eagle3Error
from shared.storage.dtypes import StorageDtype

HIDDEN_DTYPE = torch.bfloat16
NUM_AUX_LAYERS = 3  # EAGLE-3 concatenates three aux layers: a capture names exactly three layer ids

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
HIDDEN_FIELDS = ("aux_hidden_state", "hidden_state")


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


def quantize_fp8(tensor: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, groups * W] bf16 -> (e4m3 [L, groups * W], float32 scales [L, groups]): one scale per row and group."""
    L, width = tensor.shape
    grouped = tensor.float().reshape(L, groups, width // groups)  # (L, groups, W)
    scale = grouped.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    quantized = (grouped / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.reshape(L, width), scale.squeeze(-1)


def dequantize_fp8(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., L, groups * W] e4m3 and [..., L, groups] scales -> bf16 [..., L, groups * W]."""
    *lead, width = quantized.shape
    groups = scale.shape[-1]
    grouped = quantized.float().reshape(*lead, groups, width // groups) * scale.unsqueeze(-1)
    return grouped.reshape(*lead, width).to(HIDDEN_DTYPE)


class _UnlockedReader(io.RawIOBase):
    """A seekable stream of `data` whose reads copy with numpy, which lets go of the GIL while it copies.

    torch.load reads each tensor of a stream into the tensor's memory through `readinto`; from an io.BytesIO that copy
    holds the GIL (about 30 ms of a 67 MB sample at 8B width), and a trainer's loader threads decode while its step's
    Python needs the GIL to launch kernels."""

    def __init__(self, data: bytes) -> None:
        self._data = np.frombuffer(data, dtype=np.uint8)
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._data)}[whence]
        self._position = max(start + offset, 0)
        return self._position

    def readinto(self, buffer: Buffer) -> int:
        target = np.frombuffer(memoryview(buffer).cast("B"), dtype=np.uint8)
        count = max(min(len(target), len(self._data) - self._position), 0)
        np.copyto(target[:count], self._data[self._position : self._position + count])
        self._position += count
        return count


class ByteStream(Protocol):
    """What torch.save writes to: a binary stream with write and flush (io.BytesIO, a file, a hashing writer)."""

    def write(self, data: bytes | bytearray | memoryview, /) -> int: ...
    def flush(self) -> None: ...


def encode_sample(
    input_ids: list[int],
    loss_mask: list[int],
    aux_hidden_state: torch.Tensor,
    hidden_state: torch.Tensor,
    *,
    storage_dtype: StorageDtype = "bfloat16",
) -> bytes:
    buffer = io.BytesIO()
    write_sample(buffer, input_ids, loss_mask, aux_hidden_state, hidden_state, storage_dtype=storage_dtype)
    return buffer.getvalue()


def write_sample(
    out: ByteStream,
    input_ids: list[int],
    loss_mask: list[int],
    aux_hidden_state: torch.Tensor,
    hidden_state: torch.Tensor,
    *,
    storage_dtype: StorageDtype = "bfloat16",
) -> None:
    """The sample file's bytes, written to `out` as torch.save produces them (what encode_sample returns)."""
    record = {
        "input_ids": torch.tensor(input_ids, dtype=torch.long),  # [L]
        "loss_mask": torch.tensor(loss_mask, dtype=torch.long),  # [L]
    }
    if storage_dtype == "bfloat16":
        record["aux_hidden_state"] = aux_hidden_state.contiguous().unsqueeze(0)  # [L, 3H] -> [1, L, 3H]
        record["hidden_state"] = hidden_state.contiguous().unsqueeze(0)  # [L, H] -> [1, L, H]
    elif storage_dtype == "fp8_e4m3":
        for field, tensor, groups in (
            ("aux_hidden_state", aux_hidden_state, NUM_AUX_LAYERS),
            ("hidden_state", hidden_state, 1),
        ):
            quantized, scale = quantize_fp8(tensor, groups)
            record[field] = quantized.unsqueeze(0)  # [1, L, groups * W]
            record[f"{field}_scale"] = scale.unsqueeze(0)  # [1, L, groups]
    else:
        raise ValueError(f"storage_dtype {storage_dtype!r}: expected 'bfloat16' or 'fp8_e4m3'")
    # torch.save types its target as a path or an IO[bytes], but of a stream it calls only write and flush.
    torch.save(record, cast(IO[bytes], out))


def decode_sample(data: bytes) -> dict[str, torch.Tensor]:
    """The record with bf16 hidden states, whichever dtype it was stored in."""
    # weights_only: the files live in a shared bucket, and a pickle from it must never run code.
    record = torch.load(cast(IO[bytes], _UnlockedReader(data)), weights_only=True)
    missing = {"input_ids", "loss_mask", *HIDDEN_FIELDS} - set(record)
    if missing:
        raise InvalidCapture(", ".join(sorted(missing)), "missing from the sample record")
    for field in HIDDEN_FIELDS:
        if record[field].dtype == FP8_DTYPE:
            scale = record.pop(f"{field}_scale", None)
            if scale is None:
                raise InvalidCapture(f"{field}_scale", f"missing: {field} is stored as fp8")
            if scale.shape[:-1] != record[field].shape[:-1] or record[field].shape[-1] % scale.shape[-1]:
                raise InvalidCapture(
                    f"{field}_scale",
                    f"shape {list(scale.shape)} does not fit {field} {list(record[field].shape)}",
                )
            record[field] = dequantize_fp8(record[field], scale)
    return record

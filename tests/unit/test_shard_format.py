import io

import pytest
import torch

from shared.storage import sample_format
from shared.storage.dtypes import StorageDtype
from shared.storage.sample_format import InvalidCapture, decode_sample, encode_sample, validate_capture

H = 8


def states(rows: int = 5, hidden: int = H) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(rows, 3 * hidden).bfloat16(), torch.randn(rows, hidden).bfloat16()


def test_valid_capture_passes() -> None:
    aux, hidden = states()
    validate_capture(aux, hidden, num_tokens=5, hidden_size=H)


def _fewer_rows() -> tuple[torch.Tensor, torch.Tensor]:
    aux, hidden = states()
    return aux[:4], hidden[:4]


def _nan() -> tuple[torch.Tensor, torch.Tensor]:
    aux, hidden = states()
    hidden[2, 3] = float("nan")
    return aux, hidden


def _zeros() -> tuple[torch.Tensor, torch.Tensor]:
    aux, _ = states()
    return aux, torch.zeros(5, H, dtype=torch.bfloat16)


def _wrong_width() -> tuple[torch.Tensor, torch.Tensor]:
    return states(hidden=H + 1)


def _fp32() -> tuple[torch.Tensor, torch.Tensor]:
    aux, hidden = states()
    return aux.float(), hidden


@pytest.mark.parametrize(
    ("make", "field", "reason"),
    [
        pytest.param(_fewer_rows, "aux_hidden_state", "4 rows for a prompt of 5 tokens", id="fewer-rows"),
        pytest.param(_nan, "hidden_state", "1 non-finite values", id="nan"),
        pytest.param(_zeros, "hidden_state", "all zeros", id="all-zero"),
        pytest.param(_wrong_width, "aux_hidden_state", "width 27, expected 24", id="wrong-hidden-size"),
        pytest.param(_fp32, "aux_hidden_state", "dtype torch.float32", id="wrong-dtype"),
    ],
)
def test_invalid_capture_names_field_and_reason(make, field: str, reason: str) -> None:
    aux, hidden = make()
    with pytest.raises(InvalidCapture) as info:
        validate_capture(aux, hidden, num_tokens=5, hidden_size=H)
    assert info.value.field == field
    assert reason in info.value.reason


def test_sample_round_trip_has_specforge_layout() -> None:
    aux, hidden = states()
    record = decode_sample(encode_sample([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], aux, hidden))
    assert record["input_ids"].dtype == torch.long and record["input_ids"].tolist() == [1, 2, 3, 4, 5]
    assert record["loss_mask"].dtype == torch.long and record["loss_mask"].tolist() == [0, 0, 1, 1, 1]
    assert record["aux_hidden_state"].shape == (1, 5, 3 * H) and record["aux_hidden_state"].dtype == torch.bfloat16
    assert record["hidden_state"].shape == (1, 5, H)
    assert torch.equal(record["aux_hidden_state"][0], aux) and torch.equal(record["hidden_state"][0], hidden)


def test_decode_refuses_pickled_code() -> None:
    import io
    import os

    class Exploit:
        def __reduce__(self) -> tuple:
            return (os.system, ("true",))

    buffer = io.BytesIO()
    torch.save({"input_ids": Exploit()}, buffer)
    with pytest.raises(Exception, match="Weights only load failed"):
        decode_sample(buffer.getvalue())


def test_fp8_record_decodes_to_bf16_within_e4m3_rounding() -> None:
    # Layers of very different magnitudes, as real aux states are: each token and layer gets its own scale.
    aux, hidden = states(rows=16, hidden=64)
    aux = aux * torch.tensor([0.01, 1.0, 100.0]).repeat_interleave(64).bfloat16()
    record = decode_sample(encode_sample([1] * 16, [1] * 16, aux, hidden, storage_dtype="fp8_e4m3"))
    assert set(record) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
    for name, original in (("aux_hidden_state", aux), ("hidden_state", hidden)):
        decoded = record[name][0]
        assert decoded.dtype == torch.bfloat16 and decoded.shape == original.shape
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each token-layer's largest value.
        groups = 3 if name == "aux_hidden_state" else 1
        error = (decoded.float() - original.float()).abs().reshape(16, groups, -1)
        peak = original.float().abs().reshape(16, groups, -1).amax(-1, keepdim=True)
        assert bool((error <= peak / 16).all()), name


def test_fp8_record_is_at_most_052_of_bf16_at_smollm2_width() -> None:
    aux, hidden = states(rows=256, hidden=576)  # SmolLM2-135M's hidden size, a 256-token sample
    ids = list(range(256))
    bf16 = len(encode_sample(ids, [1] * 256, aux, hidden))
    fp8 = len(encode_sample(ids, [1] * 256, aux, hidden, storage_dtype="fp8_e4m3"))
    assert fp8 / bf16 <= 0.52, (fp8, bf16)


def test_fp8_record_without_its_scale_is_refused() -> None:
    aux, hidden = states()
    data = encode_sample([1] * 5, [1] * 5, aux, hidden, storage_dtype="fp8_e4m3")
    record = torch.load(io.BytesIO(data), weights_only=True)
    del record["hidden_state_scale"]
    buffer = io.BytesIO()
    torch.save(record, buffer)
    with pytest.raises(InvalidCapture, match="hidden_state_scale: missing"):
        decode_sample(buffer.getvalue())


@pytest.mark.parametrize("storage_dtype", ["bfloat16", "fp8_e4m3"])
def test_decode_reads_what_torch_load_reads_from_the_bytes(storage_dtype: StorageDtype) -> None:
    """decode_sample streams the bytes to torch.load through a reader of its own (one that copies without the GIL):
    every tensor equals what torch.load reads from an io.BytesIO of the same bytes."""
    aux, hidden = states(rows=300, hidden=64)
    data = encode_sample(list(range(300)), [1] * 300, aux, hidden, storage_dtype=storage_dtype)
    stored = torch.load(io.BytesIO(data), weights_only=True)

    record = decode_sample(data)

    assert torch.equal(record["input_ids"], stored["input_ids"]) and torch.equal(
        record["loss_mask"], stored["loss_mask"]
    )
    for name in ("aux_hidden_state", "hidden_state"):
        if storage_dtype == "bfloat16":
            assert torch.equal(record[name], stored[name]), name
        else:
            expected = sample_format.dequantize_fp8(stored[name], stored[f"{name}_scale"])
            assert torch.equal(record[name], expected), name

import pytest
import torch

from shared.shard_format import InvalidCapture, decode_sample, encode_sample, validate_capture

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

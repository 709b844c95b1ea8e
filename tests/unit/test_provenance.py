"""The provenance record: the first differing field is named, with both values."""

import pytest

from shared.provenance import IncompatibleProvenance, Provenance, check_same


def record(**changes: object) -> Provenance:
    values: dict = {
        "target_config_sha256": "c" * 64,
        "target_weights_sha256": "w" * 64,
        "tokenizer_sha256": "t" * 64,
        "chat_template_sha256": "h" * 64,
        "aux_layer_ids": [1, 14, 26],
        "dtype": "bfloat16",
        "storage_dtype": "bfloat16",
        "vocab_mapping_sha256": "v" * 64,
        **changes,
    }
    return Provenance(**values)


def test_equal_records_pass_and_a_partial_one_is_compared_on_its_fields() -> None:
    check_same(record(), record(), what="job")
    check_same({"tokenizer_sha256": "t" * 64}, record(storage_dtype="fp8_e4m3"), what="job")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        pytest.param({"aux_layer_ids": [1, 15, 26]}, "aux_layer_ids", id="layers"),
        pytest.param({"storage_dtype": "fp8_e4m3"}, "storage_dtype", id="storage"),
        pytest.param(
            {"chat_template_sha256": "x" * 64, "vocab_mapping_sha256": "y" * 64},
            "chat_template_sha256",
            id="first-of-two",
        ),
    ],
)
def test_a_difference_is_refused_naming_the_field(changes: dict, field: str) -> None:
    with pytest.raises(IncompatibleProvenance, match=rf"resuming x: provenance field {field} is ") as info:
        check_same(record(**changes), record(), what="resuming x")
    assert info.value.field == field

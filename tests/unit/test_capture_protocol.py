import json
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch
from pydantic import ValidationError

from shared.capture.protocol import (
    CapturedStates,
    CaptureSpec,
    GenerateRequest,
    SamplingParams,
    capture_file_name,
    decode_capture_body,
    default_aux_layer_ids,
    encode_capture_body,
    read_capture_file,
    write_capture_file,
)
from shared.errors import InferenceProtocolError

H = 8  # hidden size of the fake captures


def make_states(lengths: list[int], seed: int = 0) -> list[CapturedStates]:
    """Captures that are views into one padded batch tensor, the way the server produces them."""
    generator = torch.Generator().manual_seed(seed)
    aux = torch.randn(len(lengths), max(lengths), 3 * H, generator=generator).to(torch.bfloat16)  # (B, T, 3H)
    final = torch.randn(len(lengths), max(lengths), H, generator=generator).to(torch.bfloat16)  # (B, T, H)
    return [
        CapturedStates(aux[b, :length], final[b, :length], {"id": f"sample-{b}", "prompt_tokens": length})
        for b, length in enumerate(lengths)
    ]


def test_body_round_trip_is_bit_exact_with_meta_info_per_prompt() -> None:
    states = make_states([5, 2, 7])

    decoded = decode_capture_body(encode_capture_body(states))

    assert len(decoded) == 3
    for original, back in zip(states, decoded, strict=True):
        assert torch.equal(back.aux_hidden_state, original.aux_hidden_state)
        assert torch.equal(back.hidden_state, original.hidden_state)
        assert back.aux_hidden_state.dtype == torch.bfloat16
        assert back.meta_info == original.meta_info


def test_body_is_standard_safetensors() -> None:
    states = make_states([3, 4])
    body = bytes(encode_capture_body(states))

    tensors = safetensors.torch.load(body)

    assert set(tensors) == {"aux_hidden_state.0", "hidden_state.0", "aux_hidden_state.1", "hidden_state.1"}
    assert torch.equal(tensors["aux_hidden_state.1"], states[1].aux_hidden_state)
    header = json.loads(body[8 : 8 + int.from_bytes(body[:8], "little")])
    assert json.loads(header["__metadata__"]["meta_info"]) == [s.meta_info for s in states]


def test_decode_reads_a_body_written_by_the_safetensors_library() -> None:
    aux, hidden = torch.randn(4, 3 * H).to(torch.bfloat16), torch.randn(4, H).to(torch.bfloat16)
    body = safetensors.torch.save(
        {"aux_hidden_state.0": aux, "hidden_state.0": hidden}, metadata={"meta_info": json.dumps([{"id": "x"}])}
    )

    [states] = decode_capture_body(body)

    assert torch.equal(states.aux_hidden_state, aux) and torch.equal(states.hidden_state, hidden)
    assert states.meta_info == {"id": "x"}


def test_decoded_tensors_view_a_writable_body_without_copying() -> None:
    body = encode_capture_body(make_states([3]))

    [states] = decode_capture_body(body)
    states.hidden_state[0, 0] = 42.0

    assert decode_capture_body(body)[0].hidden_state[0, 0] == 42.0


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        pytest.param(b"\x01\x02", "shorter than the header length", id="truncated-header"),
        pytest.param((10**6).to_bytes(8, "little") + b"{}", "header length", id="header-past-end"),
        pytest.param((4).to_bytes(8, "little") + b"nope", "not JSON", id="header-not-json"),
        pytest.param(
            safetensors.torch.save({"aux_hidden_state.0": torch.zeros(2, 3), "hidden_state.0": torch.zeros(2, 1)}),
            "no meta_info",
            id="no-meta-info",
        ),
        pytest.param(
            safetensors.torch.save({"hidden_state.0": torch.zeros(2, 1)}, metadata={"meta_info": "[{}]"}),
            "need tensors",
            id="missing-tensor",
        ),
        pytest.param(
            safetensors.torch.save({"hidden_state.0": torch.zeros(2, 1)}, metadata={"meta_info": "{}"}),
            "JSON list",
            id="meta-info-not-a-list",
        ),
    ],
)
def test_decode_rejects_a_body_that_does_not_follow_the_protocol(body: bytes, reason: str) -> None:
    with pytest.raises(InferenceProtocolError, match=reason):
        decode_capture_body(body)


def test_decode_rejects_offsets_outside_the_data() -> None:
    body = bytearray(encode_capture_body(make_states([3])))
    del body[-10:]  # the last tensor's bytes run past the end now

    with pytest.raises(InferenceProtocolError, match="does not fit"):
        decode_capture_body(body)


def test_capture_file_round_trip_leaves_no_temporary_file(tmp_path: Path) -> None:
    [states] = make_states([6])

    path = write_capture_file(tmp_path, "job-1_sample-3.safetensors", states)
    aux, hidden = read_capture_file(path)

    assert path == tmp_path / "job-1_sample-3.safetensors"
    assert os.listdir(tmp_path) == ["job-1_sample-3.safetensors"]
    assert torch.equal(aux, states.aux_hidden_state) and torch.equal(hidden, states.hidden_state)
    assert set(safetensors.torch.load_file(path)) == {"aux_hidden_state", "hidden_state"}


def test_read_capture_file_names_the_file_when_tensors_are_missing(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    safetensors.torch.save_file({"hidden_state": torch.zeros(2, H)}, path)

    with pytest.raises(InferenceProtocolError, match=r"bad\.safetensors.*aux_hidden_state"):
        read_capture_file(path)


@pytest.mark.parametrize(
    ("rid", "name"),
    [
        pytest.param("job-1/shard-0/sample-7", "job-1_shard-0_sample-7.safetensors", id="slashes"),
        pytest.param("../../etc/passwd", ".._.._etc_passwd.safetensors", id="traversal"),
    ],
)
def test_capture_file_name_is_one_flat_name(rid: str, name: str) -> None:
    assert capture_file_name(rid) == name


def test_capture_spec_needs_exactly_three_layer_ids_and_a_known_transport() -> None:
    assert CaptureSpec(aux_layer_ids=[1, 14, 26]).transport == "body"
    with pytest.raises(ValidationError, match="aux_layer_ids"):
        CaptureSpec(aux_layer_ids=[1, 14])
    with pytest.raises(ValidationError, match="transport"):
        CaptureSpec.model_validate({"aux_layer_ids": [1, 14, 26], "transport": "tcp"})


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"input_ids": [1, "2"]}, id="string-token"),
        pytest.param({"input_ids": [1, True]}, id="bool-token"),
        pytest.param({"input_ids": [[1], 2]}, id="mixed-batch"),
        pytest.param({"input_ids": [1], "text": "hi"}, id="ids-and-text"),
        pytest.param({}, id="no-prompt"),
        pytest.param({"input_ids": [1], "sampling_params": {"top_k": 0}}, id="top-k-zero"),
        pytest.param({"input_ids": [1], "sampling_params": {"stop": ["x"]}}, id="unknown-sampling-param"),
    ],
)
def test_generate_request_rejects_malformed_bodies(body: dict) -> None:
    with pytest.raises(ValidationError):
        GenerateRequest.model_validate(body)


def test_generate_request_accepts_single_and_batched_prompts() -> None:
    assert GenerateRequest.model_validate({"input_ids": [1, 2]}).input_ids == [1, 2]
    assert GenerateRequest.model_validate({"input_ids": [[1], [2, 3]]}).input_ids == [[1], [2, 3]]
    assert GenerateRequest.model_validate({"text": ["a", "b"]}).sampling_params == SamplingParams()


def test_default_aux_layer_ids_follow_eagle3() -> None:
    assert default_aux_layer_ids(32) == [1, 15, 28]  # Llama-3.1-8B
    assert default_aux_layer_ids(8) == [1, 3, 4]

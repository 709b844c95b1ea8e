"""Capture requests: shapes, dtypes, row counts, layer ids, the final state, both transports, request ids."""

from typing import Any

import pytest
import torch

from shared.capture.client import InferenceClient
from shared.capture.protocol import CAPTURE_CONTENT_TYPE, CapturedStates, ModelInfo, decode_capture_body
from tests.conformance.builders import (
    alternative_layer_ids,
    capturable,
    capture_body,
    error_message,
    post_generate,
    random_prompt,
)
from tests.conformance.conftest import ServerUnderTest
from tests.conformance.hf_reference import HFReference, assert_aux_matches_layers, assert_final_is_post_norm
from tests.reference_checks import relative_error

# Two captures of the same prompt in different batches (padding, batch shape, kernels) agree this well in bf16.
SAME_STATE_REL_TOL = 0.02


def assert_capture_shape(states: CapturedStates, prompt: list[int], info: ModelInfo) -> None:
    rows, hidden = len(prompt), info.hidden_size
    assert states.aux_hidden_state.shape == (rows, 3 * hidden), "aux_hidden_state must be [prompt length, 3H]"
    assert states.hidden_state.shape == (rows, hidden), "hidden_state must be [prompt length, H]"
    assert states.aux_hidden_state.dtype == states.hidden_state.dtype == torch.bfloat16
    assert torch.isfinite(states.aux_hidden_state).all() and torch.isfinite(states.hidden_state).all()
    assert states.aux_hidden_state.abs().sum() > 0 and states.hidden_state.abs().sum() > 0


def assert_same_state(a: CapturedStates, b: CapturedStates) -> None:
    assert relative_error(a.aux_hidden_state, b.aux_hidden_state) < SAME_STATE_REL_TOL
    assert relative_error(a.hidden_state, b.hidden_state) < SAME_STATE_REL_TOL


# ----------------------------------------------------------------------------------------------------------
# Shapes, dtypes, row counts, meta_info


@pytest.mark.parametrize("length", [1, 2, 17, 64])
def test_capture_has_one_bf16_row_per_prompt_token(client: InferenceClient, model_info: ModelInfo, length: int) -> None:
    prompt = random_prompt(model_info, length, seed=length)

    states = client.capture(prompt, f"conformance/shape-{length}", model_info.default_aux_layer_ids)

    assert_capture_shape(states, prompt, model_info)


def test_capture_meta_info_describes_the_capture(client: InferenceClient, model_info: ModelInfo) -> None:
    prompt = random_prompt(model_info, 12, seed=3)

    states = client.capture(prompt, "conformance/meta", model_info.default_aux_layer_ids)

    meta = states.meta_info
    assert meta["id"] == "conformance/meta"
    assert meta["prompt_tokens"] == 12
    assert meta["completion_tokens"] <= 1
    assert meta["capture"]["aux_layer_ids"] == model_info.default_aux_layer_ids
    assert meta["capture"]["rows"] == 12
    assert meta["capture"]["hidden_size"] == model_info.hidden_size
    assert meta["capture"]["dtype"] == "bfloat16"
    assert "path" not in meta["capture"]  # transport "body"


def test_body_transport_answers_safetensors_bytes(server: ServerUnderTest, model_info: ModelInfo) -> None:
    prompt = random_prompt(model_info, 5, seed=4)

    response = post_generate(server.url, capture_body(prompt, model_info.default_aux_layer_ids, rid="conformance/ct"))

    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith(CAPTURE_CONTENT_TYPE)
    (states,) = decode_capture_body(bytearray(response.content))
    assert states.meta_info["id"] == "conformance/ct"
    assert_capture_shape(states, prompt, model_info)


def test_capture_with_no_generated_token_still_captures_every_row(
    client: InferenceClient, server: ServerUnderTest, model_info: ModelInfo
) -> None:
    prompt = random_prompt(model_info, 9, seed=5)

    response = post_generate(server.url, capture_body(prompt, model_info.default_aux_layer_ids, max_new_tokens=0))

    assert response.status_code == 200, response.text
    (states,) = decode_capture_body(bytearray(response.content))
    assert_capture_shape(states, prompt, model_info)
    assert states.meta_info["completion_tokens"] == 0


# ----------------------------------------------------------------------------------------------------------
# Batches and concurrency: rows never move between prompts


def test_batched_request_returns_true_length_rows_per_prompt(
    server: ServerUnderTest, client: InferenceClient, model_info: ModelInfo
) -> None:
    prompts = [random_prompt(model_info, length, seed=10 + length) for length in (3, 31, 9)]
    rids = ["conformance/batch/0", "conformance/batch/1", "conformance/batch/2"]

    response = post_generate(server.url, capture_body(prompts, model_info.default_aux_layer_ids, rid=rids))

    assert response.status_code == 200, response.text
    batched = decode_capture_body(bytearray(response.content))
    assert [s.meta_info["id"] for s in batched] == rids
    for prompt, states in zip(prompts, batched, strict=True):
        assert_capture_shape(states, prompt, model_info)
        assert states.meta_info["capture"]["rows"] == len(prompt)
        assert_same_state(states, client.capture(prompt, "conformance/batch/single", model_info.default_aux_layer_ids))


def test_concurrent_captures_keep_their_own_rows(client: InferenceClient, model_info: ModelInfo) -> None:
    prompts = {f"conformance/concurrent/{i}": random_prompt(model_info, 5 + 7 * i, seed=20 + i) for i in range(6)}

    results = list(client.capture_many(list(prompts.items()), model_info.default_aux_layer_ids))

    assert [r.meta_info["id"] for r in results] == list(prompts)
    for states, prompt in zip(results, prompts.values(), strict=True):
        assert_capture_shape(states, prompt, model_info)
        assert_same_state(
            states, client.capture(prompt, "conformance/concurrent/single", model_info.default_aux_layer_ids)
        )


# ----------------------------------------------------------------------------------------------------------
# Layer ids and values


def test_default_layers_and_final_state_match_transformers(
    client: InferenceClient, model_info: ModelInfo, hf: HFReference
) -> None:
    for seed, length in [(30, 24), (31, 57)]:
        prompt = random_prompt(model_info, length, seed=seed)

        states = client.capture(prompt, f"conformance/values-{seed}", model_info.default_aux_layer_ids)

        reference = hf.states(prompt)
        assert_aux_matches_layers(states.aux_hidden_state, reference, model_info.default_aux_layer_ids)
        assert_final_is_post_norm(states.hidden_state, reference)


def test_other_layer_ids_are_honoured_or_refused_by_name(
    server: ServerUnderTest, model_info: ModelInfo, model_info_json: dict[str, Any]
) -> None:
    layer_ids = alternative_layer_ids(model_info)
    prompt = random_prompt(model_info, 19, seed=40)

    response = post_generate(server.url, capture_body(prompt, layer_ids))

    if not capturable(model_info_json, layer_ids):
        assert response.status_code == 400, response.text
        assert "capture.aux_layer_ids" in error_message(response)
        return
    assert response.status_code == 200, response.text
    (states,) = decode_capture_body(bytearray(response.content))
    assert_capture_shape(states, prompt, model_info)
    assert states.meta_info["capture"]["aux_layer_ids"] == layer_ids


def test_other_layer_ids_match_transformers(
    client: InferenceClient, model_info: ModelInfo, model_info_json: dict[str, Any], hf: HFReference
) -> None:
    layer_ids = alternative_layer_ids(model_info)
    if not capturable(model_info_json, layer_ids):
        pytest.skip(f"the server captures only {model_info_json['capture_aux_layer_ids']}")
    prompt = random_prompt(model_info, 19, seed=41)

    states = client.capture(prompt, "conformance/other-layers", layer_ids)

    assert_aux_matches_layers(states.aux_hidden_state, hf.states(prompt), layer_ids)


def test_aux_slices_follow_the_order_of_the_requested_ids(client: InferenceClient, model_info: ModelInfo) -> None:
    ids = model_info.default_aux_layer_ids
    shuffled = [ids[2], ids[0], ids[1]]
    prompt = random_prompt(model_info, 15, seed=50)
    hidden = model_info.hidden_size

    in_order = client.capture(prompt, "conformance/order/a", ids)
    out_of_order = client.capture(prompt, "conformance/order/b", shuffled)

    assert out_of_order.meta_info["capture"]["aux_layer_ids"] == shuffled
    for slot, layer_id in enumerate(shuffled):
        expected = in_order.aux_hidden_state[:, ids.index(layer_id) * hidden : (ids.index(layer_id) + 1) * hidden]
        actual = out_of_order.aux_hidden_state[:, slot * hidden : (slot + 1) * hidden]
        assert relative_error(actual, expected) < SAME_STATE_REL_TOL, f"slot {slot} is not layer {layer_id}"


# ----------------------------------------------------------------------------------------------------------
# Transport "shm"


def test_shm_transport_writes_the_same_tensors_to_a_file_named_in_meta_info(
    client: InferenceClient, shm_client: InferenceClient, server: ServerUnderTest, model_info: ModelInfo
) -> None:
    prompt = random_prompt(model_info, 21, seed=60)

    by_body = client.capture(prompt, "conformance/shm/0", model_info.default_aux_layer_ids)
    by_shm = shm_client.capture(prompt, "conformance/shm/0", model_info.default_aux_layer_ids)

    path = by_shm.meta_info["capture"]["path"]
    assert "/" not in path and path.endswith(".safetensors"), f"{path!r} must be a plain name in the shared dir"
    assert not (server.shm_dir / path).exists(), "the client deletes the file after reading it"
    assert by_shm.meta_info["capture"]["rows"] == len(prompt)
    assert_capture_shape(by_shm, prompt, model_info)
    assert_same_state(by_shm, by_body)


def test_shm_transport_answers_json_per_prompt_of_a_batch(
    server: ServerUnderTest, shm_client: InferenceClient, model_info: ModelInfo
) -> None:
    prompts = [random_prompt(model_info, length, seed=70 + length) for length in (4, 11)]
    rids = ["conformance/shm-batch/0", "conformance/shm-batch/1"]

    response = post_generate(
        server.url, capture_body(prompts, model_info.default_aux_layer_ids, transport="shm", rid=rids)
    )

    assert response.status_code == 200, response.text
    outputs = response.json()
    assert [o["meta_info"]["id"] for o in outputs] == rids
    paths = [server.shm_dir / o["meta_info"]["capture"]["path"] for o in outputs]
    try:
        for output, prompt, path in zip(outputs, prompts, paths, strict=True):
            assert output["meta_info"]["capture"]["rows"] == len(prompt)
            assert path.exists()
    finally:
        for path in paths:
            path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------------------
# Request ids


def test_each_prompt_gets_its_own_id_when_none_is_given(server: ServerUnderTest, model_info: ModelInfo) -> None:
    prompts = [random_prompt(model_info, 6, seed=80), random_prompt(model_info, 6, seed=81)]

    response = post_generate(server.url, capture_body(prompts, model_info.default_aux_layer_ids))

    assert response.status_code == 200, response.text
    ids = [s.meta_info["id"] for s in decode_capture_body(bytearray(response.content))]
    assert len(ids) == 2 and len(set(ids)) == 2 and all(isinstance(i, str) and i for i in ids)


@pytest.mark.parametrize(
    "rid",
    [
        pytest.param(["conformance/dup", "conformance/dup"], id="duplicate-in-batch"),
        pytest.param(["conformance/only-one"], id="fewer-than-prompts"),
        pytest.param("conformance/one-string-for-a-batch", id="string-for-batch"),
    ],
)
def test_request_ids_must_be_one_unique_id_per_prompt(
    server: ServerUnderTest, model_info: ModelInfo, rid: str | list[str]
) -> None:
    prompts = [random_prompt(model_info, 4, seed=90), random_prompt(model_info, 4, seed=91)]

    response = post_generate(server.url, capture_body(prompts, model_info.default_aux_layer_ids, rid=rid))

    assert response.status_code == 400, response.text
    assert "rid" in error_message(response)

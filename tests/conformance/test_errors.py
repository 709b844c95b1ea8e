"""Malformed capture requests: 400 with `{"error": {"message": ...}}` naming the field."""

from collections.abc import Callable
from typing import Any

import pytest

from shared.capture.protocol import ModelInfo
from tests.conformance.builders import capture_body, error_message, post_generate, random_prompt
from tests.conformance.conftest import ServerUnderTest

# (name, body builder, the field the message must name)
BadRequest = Callable[[ModelInfo], dict[str, Any]]


def _ids(info: ModelInfo) -> list[int]:
    return info.default_aux_layer_ids


def _prompt(info: ModelInfo) -> list[int]:
    return random_prompt(info, 8, seed=100)


BAD_REQUESTS = [
    pytest.param(
        lambda info: capture_body(_prompt(info), [*_ids(info)[:2], info.num_hidden_layers + 3]),
        "capture.aux_layer_ids",
        id="layer-id-past-the-last-layer",
    ),
    pytest.param(
        lambda info: capture_body(_prompt(info), [-1, *_ids(info)[1:]]),
        "capture.aux_layer_ids",
        id="negative-layer-id",
    ),
    pytest.param(
        lambda info: capture_body(_prompt(info), _ids(info)[:2]),
        "capture.aux_layer_ids",
        id="two-layer-ids",
    ),
    pytest.param(
        lambda info: capture_body(_prompt(info), [*_ids(info), 0]),
        "capture.aux_layer_ids",
        id="four-layer-ids",
    ),
    pytest.param(lambda info: capture_body([], _ids(info)), "input_ids", id="empty-prompt"),
    pytest.param(
        lambda info: capture_body([_prompt(info), []], _ids(info)),
        "input_ids[1]",
        id="empty-prompt-in-batch",
    ),
    pytest.param(
        lambda info: capture_body([*_prompt(info), info.vocab_size + 7], _ids(info)),
        "input_ids",
        id="token-id-outside-vocabulary",
    ),
    pytest.param(
        lambda info: capture_body([5, -2, 6], _ids(info)),
        "input_ids",
        id="negative-token-id",
    ),
    pytest.param(
        lambda info: {**capture_body(_prompt(info), _ids(info)), "input_ids": ["a", "b"]},
        "input_ids",
        id="token-ids-not-integers",
    ),
    pytest.param(
        lambda info: capture_body(_prompt(info), _ids(info), transport="carrier-pigeon"),
        "capture.transport",
        id="unknown-transport",
    ),
    pytest.param(
        lambda info: {**capture_body(_prompt(info), _ids(info)), "capture": {"aux_layer_ids": _ids(info), "fmt": 1}},
        "capture.fmt",
        id="unknown-capture-field",
    ),
    pytest.param(
        lambda info: capture_body(_prompt(info), _ids(info), max_new_tokens=8),
        "sampling_params.max_new_tokens",
        id="capture-with-decoding",
    ),
]


@pytest.mark.parametrize(("build", "field"), BAD_REQUESTS)
def test_bad_capture_request_is_refused_naming_the_field(
    server: ServerUnderTest, model_info: ModelInfo, build: BadRequest, field: str
) -> None:
    response = post_generate(server.url, build(model_info))

    assert response.status_code == 400, f"{response.status_code}: {response.text[:300]}"
    message = error_message(response)
    assert field in message, f"message does not name {field}: {message}"


def test_prompt_longer_than_the_context_is_refused(server: ServerUnderTest, model_info: ModelInfo) -> None:
    if model_info.max_context_length > 32768:
        pytest.skip(f"a {model_info.max_context_length + 1}-token prompt is too large a request for this suite")
    prompt = random_prompt(model_info, model_info.max_context_length + 1, seed=101)

    response = post_generate(server.url, capture_body(prompt, model_info.default_aux_layer_ids))

    assert response.status_code == 400, response.text[:300]
    assert "input_ids" in error_message(response)


def test_a_refused_request_leaves_the_server_serving(server: ServerUnderTest, model_info: ModelInfo) -> None:
    post_generate(server.url, capture_body([], model_info.default_aux_layer_ids))

    response = post_generate(server.url, capture_body(random_prompt(model_info, 3, seed=102), _ids(model_info)))

    assert response.status_code == 200, response.text[:300]

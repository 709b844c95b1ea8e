"""Requests without `capture`: plain SGLang `/generate`, used for the regeneration stage."""

from shared.capture_protocol import CAPTURE_CONTENT_TYPE, ModelInfo
from shared.inference_client import InferenceClient
from tests.conformance.builders import post_generate, random_prompt
from tests.conformance.conftest import ServerUnderTest


def assert_decoded(output: dict, max_new_tokens: int) -> None:
    output_ids = output["output_ids"]
    meta = output["meta_info"]
    assert 1 <= len(output_ids) <= max_new_tokens
    assert meta["completion_tokens"] == len(output_ids)
    assert "capture" not in meta
    finish = meta["finish_reason"]
    if finish["type"] == "length":
        assert finish["length"] == max_new_tokens == len(output_ids)
    else:
        assert finish["type"] == "stop", finish


def test_greedy_decoding_generates_up_to_max_new_tokens(client: InferenceClient, model_info: ModelInfo) -> None:
    prompt = random_prompt(model_info, 10, seed=200)
    params = {"max_new_tokens": 6, "temperature": 0}

    first = client.generate(input_ids=prompt, sampling_params=params, rid="conformance/decode/0")
    second = client.generate(input_ids=prompt, sampling_params=params, rid="conformance/decode/1")

    assert isinstance(first, dict) and isinstance(second, dict)
    assert_decoded(first, 6)
    assert first["meta_info"]["id"] == "conformance/decode/0"
    assert first["meta_info"]["prompt_tokens"] == len(prompt)
    assert first["output_ids"] == second["output_ids"], "greedy decoding must be repeatable"


def test_a_batch_of_prompts_decodes_into_a_list(client: InferenceClient, model_info: ModelInfo) -> None:
    prompts = [random_prompt(model_info, 5, seed=201), random_prompt(model_info, 13, seed=202)]

    outputs = client.generate(input_ids=prompts, sampling_params={"max_new_tokens": 3, "temperature": 0})

    assert isinstance(outputs, list) and len(outputs) == 2
    for output in outputs:
        assert_decoded(output, 3)


def test_a_request_without_capture_answers_json(server: ServerUnderTest, model_info: ModelInfo) -> None:
    body = {"input_ids": random_prompt(model_info, 4, seed=203), "sampling_params": {"max_new_tokens": 1}}

    response = post_generate(server.url, body)

    assert response.status_code == 200, response.text[:300]
    assert not response.headers["content-type"].startswith(CAPTURE_CONTENT_TYPE)
    assert_decoded(response.json(), 1)

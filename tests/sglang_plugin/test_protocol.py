"""HTTP side: checking capture requests, building SGLang's GenerateReqInput fields, translating SGLang's answer."""

from typing import Any

import pytest
from eagle3_sglang_plugin.capture import CAPTURE_META_KEY, CaptureTicket
from eagle3_sglang_plugin.protocol import (
    BODY_SPOOL_PREFIX,
    CaptureFailed,
    ModelLimits,
    model_info_answer,
    plan_capture,
    protocol_outputs,
    sglang_generate_kwargs,
)

from shared.capture.protocol import InvalidRequest, ModelInfo, request_ids

LIMITS = ModelLimits(
    num_hidden_layers=8, hidden_size=64, vocab_size=512, max_context_length=1023, capture_aux_layer_ids=[1, 3, 4]
)


def body(**overrides: Any) -> dict[str, Any]:
    return {
        "input_ids": [5, 6, 7],
        "rid": "job-1/sample-1",
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "capture": {"aux_layer_ids": [1, 3, 4], "transport": "body"},
        **overrides,
    }


def sglang_output(rid: str, rows: int, file_name: str, **meta: Any) -> dict[str, Any]:
    """One entry of SGLang's /generate answer as TokenizerManager builds it (skip_tokenizer_init: no text)."""
    return {
        "output_ids": [42],
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": rows,
            "completion_tokens": 1,
            "cached_tokens": 0,
            "hidden_states": [],
            CAPTURE_META_KEY: [{"file": file_name, "rows": rows, "hidden_size": 64}],
            **meta,
        },
    }


# ----------------------------------------------------------------------------------------------------------
# Checking requests: the reference server's 400s


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        pytest.param({"capture": {"aux_layer_ids": [1, 3, 9]}}, "capture.aux_layer_ids", id="layer-past-the-end"),
        pytest.param({"capture": {"aux_layer_ids": [1, 3, 5]}}, "capture.aux_layer_ids", id="layer-not-captured"),
        pytest.param({"capture": {"aux_layer_ids": [1, 3]}}, "capture.aux_layer_ids", id="two-layers"),
        pytest.param({"capture": {"aux_layer_ids": [1, 3, 4], "transport": "x"}}, "capture.transport", id="transport"),
        pytest.param({"input_ids": []}, "input_ids: empty prompt", id="empty-prompt"),
        pytest.param({"input_ids": [[5], []], "rid": ["a", "b"]}, "input_ids[1]: empty prompt", id="empty-in-batch"),
        pytest.param({"input_ids": [5, 512]}, "input_ids[1]: token id 512", id="outside-vocabulary"),
        pytest.param({"input_ids": [5] * 1024}, "max_context_length 1023", id="too-long"),
        pytest.param({"input_ids": None, "text": "hi"}, "text:", id="text-prompt"),
        pytest.param({"sampling_params": {"max_new_tokens": 2}}, "sampling_params.max_new_tokens", id="decoding"),
        pytest.param({"rid": ["a"]}, "rid:", id="rid-list-for-one-prompt"),
        pytest.param({"extra_key": ["a", "b"]}, "extra_key:", id="extra-key-list-for-one-prompt"),
        pytest.param({"stream": True}, "stream", id="unknown-field"),
    ],
)
def test_bad_requests_name_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest, match=field.replace("[", r"\[").replace("]", r"\]")):
        plan_capture(body(**overrides), LIMITS)


def test_rids_follow_the_reference_servers_rules() -> None:
    assert request_ids(["a", "b"], 2, is_batch=True) == ["a", "b"]
    generated = request_ids(None, 3, is_batch=True)
    assert len(set(generated)) == 3
    with pytest.raises(InvalidRequest, match="rid: ids must be unique"):
        request_ids(["a", "a"], 2, is_batch=True)
    with pytest.raises(InvalidRequest, match="rid: 1 ids for 2 prompts"):
        request_ids(["a"], 2, is_batch=True)


def test_shm_files_are_named_after_the_rid_and_body_files_are_hidden_spool_files() -> None:
    shm = plan_capture(body(capture={"aux_layer_ids": [1, 3, 4], "transport": "shm"}), LIMITS)
    spooled = plan_capture(body(), LIMITS)

    assert shm.file_names == ["job-1_sample-1.safetensors"]  # the reference server's capture_file_name
    assert spooled.file_names[0].startswith(BODY_SPOOL_PREFIX) and "/" not in spooled.file_names[0]


# ----------------------------------------------------------------------------------------------------------
# GenerateReqInput fields


def test_a_single_prompt_becomes_a_single_sglang_request_with_a_ticket() -> None:
    plan = plan_capture(
        body(capture={"aux_layer_ids": [4, 1, 3]}, sampling_params={"max_new_tokens": 0, "sampling_seed": 3}), LIMITS
    )

    kwargs = sglang_generate_kwargs(plan)

    assert kwargs["input_ids"] == [5, 6, 7] and kwargs["rid"] == "job-1/sample-1"
    assert kwargs["return_hidden_states"] is True and kwargs["stream"] is False
    sampling = kwargs["sampling_params"]
    assert sampling["max_new_tokens"] == 1  # never SGLang's prefill-only path
    assert sampling["sampling_seed"] == 3 and sampling["temperature"] == 1.0
    assert CaptureTicket.from_custom_params(sampling["custom_params"]) == CaptureTicket(plan.file_names[0], (2, 0, 1))
    assert isinstance(kwargs["extra_key"], str) and kwargs["extra_key"]


def test_a_batch_becomes_lists_with_one_fresh_extra_key_per_prompt() -> None:
    plan = plan_capture(body(input_ids=[[5, 6], [7]], rid=["a", "b"]), LIMITS)

    kwargs = sglang_generate_kwargs(plan)

    assert kwargs["input_ids"] == [[5, 6], [7]] and kwargs["rid"] == ["a", "b"]
    assert kwargs["return_hidden_states"] == [True, True]
    assert len(set(kwargs["extra_key"])) == 2
    names = [CaptureTicket.from_custom_params(p["custom_params"]).file_name for p in kwargs["sampling_params"]]
    assert names == plan.file_names


def test_the_clients_extra_key_is_kept() -> None:
    plan = plan_capture(body(extra_key="k-1"), LIMITS)

    assert sglang_generate_kwargs(plan)["extra_key"] == "k-1"


# ----------------------------------------------------------------------------------------------------------
# SGLang's answer back to the protocol


def test_sglang_meta_info_becomes_the_protocols() -> None:
    plan = plan_capture(body(capture={"aux_layer_ids": [3, 1, 4], "transport": "shm"}), LIMITS)

    (output,) = protocol_outputs(plan, sglang_output("job-1/sample-1", 3, plan.file_names[0]))

    meta = output["meta_info"]
    assert output["output_ids"] == [42]
    assert meta["id"] == "job-1/sample-1" and meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 1
    assert meta["finish_reason"] == {"type": "length", "length": 1}
    assert meta["capture"] == {
        "aux_layer_ids": [3, 1, 4],
        "rows": 3,
        "hidden_size": 64,
        "dtype": "bfloat16",
        "path": "job-1_sample-1.safetensors",
    }
    assert CAPTURE_META_KEY not in meta and "hidden_states" not in meta
    assert meta["cached_tokens"] == 0  # SGLang's own fields stay


def test_a_capture_without_a_generated_token_reports_none() -> None:
    plan = plan_capture(body(sampling_params={"max_new_tokens": 0}), LIMITS)

    (output,) = protocol_outputs(plan, sglang_output("job-1/sample-1", 3, plan.file_names[0]))

    assert output["output_ids"] == [] and output["meta_info"]["completion_tokens"] == 0
    assert output["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert "path" not in output["meta_info"]["capture"]


@pytest.mark.parametrize(
    ("capture_meta", "reason"),
    [
        pytest.param(None, "without a capture result", id="plugin-not-loaded-in-scheduler"),
        pytest.param([{"error": "computed 2 of 3 prompt positions"}], "computed 2 of 3", id="prefix-hit"),
        pytest.param([{"file": "other.safetensors", "rows": 3, "hidden_size": 64}], "expected", id="wrong-file"),
    ],
)
def test_a_missing_or_failed_capture_is_an_error(capture_meta: Any, reason: str) -> None:
    plan = plan_capture(body(), LIMITS)
    answer = sglang_output("job-1/sample-1", 3, plan.file_names[0])
    answer["meta_info"][CAPTURE_META_KEY] = capture_meta

    with pytest.raises(CaptureFailed, match=reason):
        protocol_outputs(plan, answer)


def test_model_info_adds_the_protocol_fields_to_sglangs() -> None:
    stock = {"model_path": "/models/target", "tokenizer_path": "/models/target", "is_generation": True}

    answer = model_info_answer(stock, LIMITS, dtype="bfloat16", version="0.1.0", sglang_version="0.5.23")

    info = ModelInfo.model_validate(answer)
    assert (info.backend, info.num_hidden_layers, info.hidden_size, info.vocab_size) == ("sglang", 8, 64, 512)
    assert info.default_aux_layer_ids == answer["capture_aux_layer_ids"] == [1, 3, 4]
    assert answer["sglang_version"] == "0.5.23" and answer["model_path"] == "/models/target"


def test_a_prompt_sglang_truncated_is_an_error() -> None:
    plan = plan_capture(body(), LIMITS)
    answer = sglang_output("job-1/sample-1", 2, plan.file_names[0])  # SGLang ran and captured 2 of 3 tokens

    with pytest.raises(CaptureFailed, match="ran 2 of the 3 prompt tokens"):
        protocol_outputs(plan, answer)

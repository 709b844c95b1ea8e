"""`/health` and `/get_model_info`: what the worker checks before its first shard."""

import json
from typing import Any

import httpx

from shared.capture.protocol import ModelInfo
from tests.conformance.conftest import ServerUnderTest


def test_health_answers_200_once_ready(server: ServerUnderTest, model_info: ModelInfo) -> None:
    # model_info (through the client's wait_ready) already waited for readiness.
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_model_info_has_every_field_the_worker_reads(model_info_json: dict[str, Any]) -> None:
    info = ModelInfo.model_validate(model_info_json)

    assert info.is_generation
    assert info.backend and info.version
    assert info.num_hidden_layers > 0 and info.hidden_size > 0 and info.vocab_size > 0
    assert info.max_context_length > 0
    assert info.dtype in {"bfloat16", "float16", "float32"}
    assert len(info.default_aux_layer_ids) == 3
    assert all(0 <= i < info.num_hidden_layers for i in info.default_aux_layer_ids)


def test_fixed_capture_layers_are_listed_consistently(model_info_json: dict[str, Any]) -> None:
    # Optional field: a server that captures only the layers fixed at launch (SGLang) lists them.
    fixed = model_info_json.get("capture_aux_layer_ids")
    if fixed is None:
        return
    info = ModelInfo.model_validate(model_info_json)
    assert len(fixed) == 3 and len(set(fixed)) == 3
    assert all(0 <= i < info.num_hidden_layers for i in fixed)
    assert sorted(info.default_aux_layer_ids) == sorted(fixed)


def test_model_info_matches_the_model_folder(server: ServerUnderTest, model_info: ModelInfo) -> None:
    if server.model_path is None:
        return  # nothing to compare with
    config = json.loads((server.model_path / "config.json").read_text())
    text_config = config.get("text_config") or config

    assert model_info.num_hidden_layers == text_config["num_hidden_layers"]
    assert model_info.hidden_size == text_config["hidden_size"]
    assert model_info.vocab_size == text_config["vocab_size"]

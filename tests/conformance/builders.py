"""Prompts and raw `/generate` bodies for the conformance suite (the client covers the worker's own path)."""

from typing import Any

import httpx
import torch

from shared.capture.protocol import ModelInfo

TIMEOUT_S = 120.0
FIRST_ORDINARY_TOKEN = 4  # ids below are special tokens in the tiny tokenizer; an early end-of-sequence stops decoding


def random_prompt(info: ModelInfo, length: int, seed: int) -> list[int]:
    high = min(info.vocab_size, 32000)
    return torch.randint(FIRST_ORDINARY_TOKEN, high, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def capture_body(
    input_ids: list[int] | list[list[int]],
    aux_layer_ids: list[int],
    *,
    transport: str = "body",
    rid: str | list[str] | None = None,
    max_new_tokens: int = 1,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "capture": {"aux_layer_ids": aux_layer_ids, "transport": transport},
    }
    if rid is not None:
        body["rid"] = rid
    return body


def post_generate(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=TIMEOUT_S)


def error_message(response: httpx.Response) -> str:
    """The protocol's `{"error": {"message": ...}}`; fails the test for any other error shape."""
    payload = response.json()
    assert isinstance(payload, dict) and isinstance(payload.get("error"), dict), f"not an error answer: {payload!r}"
    message = payload["error"].get("message")
    assert isinstance(message, str) and message, f"error without a message: {payload!r}"
    return message


def alternative_layer_ids(info: ModelInfo) -> list[int]:
    """A second valid id set, different from the default, inside [0, N - 2] (capturable on SGLang too)."""
    n = info.num_hidden_layers
    candidates = [0, n // 2, n - 2]
    assert len(set(candidates)) == 3, f"a {n}-layer model is too small for this suite"
    return candidates


def capturable(model_info_json: dict[str, Any], layer_ids: list[int]) -> bool:
    """Whether the server captures these layers: any valid set, unless it lists the only ones it captures.

    `capture_aux_layer_ids` (optional in /get_model_info) is how a server whose capture layers are fixed at
    launch (SGLang) says so; ModelInfo ignores unknown fields, so this reads the raw answer.
    """
    fixed = model_info_json.get("capture_aux_layer_ids")
    return fixed is None or sorted(fixed) == sorted(layer_ids)

"""The middleware in front of SGLang's app, with a stand-in for SGLang's engine.

`FakeSGLang` plays TokenizerManager + scheduler: it computes the tiny model's states with transformers, lays
them out as SGLang's logits processor does (one flattened batch, aux layers ascending), and runs the plugin's
own scheduler-side `capture_request` per request with the row offsets SGLang would use. What it cannot show is
that SGLang really calls the hooks with these tensors: that needs a GPU host (golden_check.py).
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from eagle3_sglang_plugin.capture import CAPTURE_META_KEY, CaptureTicket, CaptureWriter, capture_request, row_spans
from eagle3_sglang_plugin.http import BackendUnavailable, CaptureMiddleware
from eagle3_sglang_plugin.protocol import ModelLimits, model_info_answer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient
from transformers import AutoModelForCausalLM, PreTrainedModel

from shared.capture.protocol import CAPTURE_CONTENT_TYPE, ModelInfo, decode_capture_body, read_capture_file
from tests.reference_checks import relative_error

CAPTURE_IDS = [1, 3, 4]  # the tiny model's EAGLE-3 defaults, fixed at "launch"
H = 64


class FakeSGLang:
    """TokenizerManager.generate_request plus the scheduler's result processing, for the tiny model."""

    def __init__(self, model: PreTrainedModel, shm_dir: Path) -> None:
        self.model = model
        self.shm_dir = shm_dir
        self.writer = CaptureWriter(shm_dir, threads=2)  # as in SGLang: the files appear after the answer
        self.calls: list[dict[str, Any]] = []
        self.cached_prefix = 0  # > 0: every request "hits" the prefix cache for that many tokens
        self.unavailable = False
        self.refuse: str | None = None  # SGLang's own ValueError for the next request

    def limits(self) -> ModelLimits:
        if self.unavailable:
            raise BackendUnavailable("launched without --enable-return-aux-hidden-states")
        return ModelLimits(
            num_hidden_layers=8,
            hidden_size=H,
            vocab_size=self.model.config.vocab_size,
            max_context_length=1023,
            capture_aux_layer_ids=CAPTURE_IDS,
        )

    async def model_info(self) -> dict[str, Any]:
        stock = {"model_path": "/models/tiny", "tokenizer_path": "/models/tiny", "is_generation": True}
        return model_info_answer(stock, self.limits(), dtype="bfloat16", version="0.1.0", sglang_version="0.5.23")

    async def generate(self, kwargs: dict[str, Any], request: Request) -> Any:
        self.calls.append(kwargs)
        if self.refuse is not None:
            raise ValueError(self.refuse)
        is_batch = isinstance(kwargs["rid"], list)
        prompts = kwargs["input_ids"] if is_batch else [kwargs["input_ids"]]
        rids = kwargs["rid"] if is_batch else [kwargs["rid"]]
        params = kwargs["sampling_params"] if is_batch else [kwargs["sampling_params"]]

        # The forward: rows computed per request = prompt minus the cached prefix, flattened over the batch.
        aux_rows, final_rows, extend_lens = [], [], []
        for prompt in prompts:
            with torch.no_grad():
                out = self.model.model(torch.tensor([prompt]), output_hidden_states=True)
            computed = slice(min(self.cached_prefix, len(prompt) - 1), len(prompt))
            aux = torch.cat([out.hidden_states[i + 1][0] for i in CAPTURE_IDS], dim=-1)  # (L, 3H), ascending
            aux_rows.append(aux[computed])
            final_rows.append(out.last_hidden_state[0][computed])
            extend_lens.append(computed.stop - computed.start)
        batch_aux, batch_final = torch.cat(aux_rows), torch.cat(final_rows)  # (T, 3H), (T, H)

        # The result processor: the plugin's hook, per request, with SGLang's running offsets.
        outputs = []
        for rid, prompt, param, (start, end) in zip(rids, prompts, params, row_spans(extend_lens), strict=True):
            ticket = CaptureTicket.from_custom_params(param["custom_params"])
            assert ticket is not None
            meta = capture_request(
                writer=self.writer,
                ticket=ticket,
                rid=rid,
                aux_hidden_states=batch_aux,
                last_hidden_states=batch_final,
                start=start,
                end=end,
                prompt_len=len(prompt),
            )
            meta_info = {
                "id": rid,
                "finish_reason": {"type": "length", "length": 1},
                "prompt_tokens": len(prompt),
                "completion_tokens": 1,
                "cached_tokens": self.cached_prefix,
                "hidden_states": [],
                CAPTURE_META_KEY: [meta],
            }
            outputs.append({"output_ids": [7], "meta_info": meta_info})
        return outputs if is_batch else outputs[0]


async def stock_generate(request: Request) -> Response:
    """SGLang's own /generate, as far as these tests care: echo what arrived."""
    return JSONResponse({"stock": True, "body": (await request.body()).decode()})


async def stock_model_info(request: Request) -> Response:
    return JSONResponse({"stock": True, "model_path": "/models/tiny", "is_generation": True})


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True, dtype=torch.bfloat16).eval()


@pytest.fixture
def engine(tiny_model: PreTrainedModel, tmp_path: Path) -> FakeSGLang:
    return FakeSGLang(tiny_model, tmp_path)


@pytest.fixture
def http(engine: FakeSGLang) -> Iterator[TestClient]:
    app = Starlette(
        routes=[
            Route("/generate", stock_generate, methods=["POST", "PUT"]),
            *(Route(path, stock_model_info) for path in ("/get_model_info", "/model_info")),
        ]
    )
    app.add_middleware(CaptureMiddleware, backend=engine)
    with TestClient(app) as client:
        yield client


def capture_body(input_ids: Any, aux_layer_ids: list[int], transport: str = "body", **extra: Any) -> dict[str, Any]:
    return {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "capture": {"aux_layer_ids": aux_layer_ids, "transport": transport},
        **extra,
    }


def hf_layer(model: PreTrainedModel, prompt: list[int], layer_id: int) -> torch.Tensor:
    with torch.no_grad():
        return model.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[layer_id + 1][0]


def hf_final(model: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.model(torch.tensor([prompt])).last_hidden_state[0]


# ----------------------------------------------------------------------------------------------------------
# Capture requests


@pytest.mark.parametrize(
    "layer_ids", [pytest.param(CAPTURE_IDS, id="ascending"), pytest.param([4, 1, 3], id="shuffled")]
)
def test_body_transport_returns_each_prompts_rows_in_the_requested_layer_order(
    http: TestClient, engine: FakeSGLang, tiny_model: PreTrainedModel, layer_ids: list[int]
) -> None:
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]

    response = http.post("/generate", json=capture_body(prompts, layer_ids, rid=["a", "b", "c"]))

    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CAPTURE_CONTENT_TYPE
    states = decode_capture_body(bytearray(response.content))
    assert [s.meta_info["id"] for s in states] == ["a", "b", "c"]
    for prompt, state in zip(prompts, states, strict=True):
        assert state.meta_info["capture"] == {
            "aux_layer_ids": layer_ids,
            "rows": len(prompt),
            "hidden_size": H,
            "dtype": "bfloat16",
        }
        for slot, layer_id in enumerate(layer_ids):
            captured = state.aux_hidden_state[:, slot * H : (slot + 1) * H]
            assert torch.equal(captured, hf_layer(tiny_model, prompt, layer_id)), f"slot {slot} is not layer {layer_id}"
        assert torch.equal(state.hidden_state, hf_final(tiny_model, prompt))
    assert list(engine.shm_dir.iterdir()) == [], "spooled body files are deleted"


def test_shm_transport_leaves_one_file_per_prompt_named_in_meta_info(
    http: TestClient, engine: FakeSGLang, tiny_model: PreTrainedModel
) -> None:
    prompts = [[5, 6, 7], [8, 9, 10, 11]]

    response = http.post("/generate", json=capture_body(prompts, CAPTURE_IDS, "shm", rid=["job/0", "job/1"]))

    assert response.status_code == 200, response.text
    outputs = response.json()
    assert [o["meta_info"]["capture"]["path"] for o in outputs] == ["job_0.safetensors", "job_1.safetensors"]
    for prompt, output in zip(prompts, outputs, strict=True):
        aux, final = read_capture_file(engine.shm_dir / output["meta_info"]["capture"]["path"])
        assert aux.shape == (len(prompt), 3 * H)
        assert relative_error(final, hf_final(tiny_model, prompt)) == 0


@pytest.mark.parametrize("transport", ["body", "shm"])
def test_a_prefix_cache_hit_is_a_500_that_names_the_cause_and_leaves_no_file(
    http: TestClient, engine: FakeSGLang, transport: str
) -> None:
    engine.cached_prefix = 2

    response = http.post("/generate", json=capture_body([[5, 6, 7, 8], [9, 10, 11]], CAPTURE_IDS, transport))

    assert response.status_code == 500
    assert "computed 2 of 4 prompt positions" in response.json()["error"]["message"]
    assert list(engine.shm_dir.iterdir()) == []


def test_a_bad_request_is_answered_400_before_sglang_sees_it(http: TestClient, engine: FakeSGLang) -> None:
    response = http.post("/generate", json=capture_body([5, 6], [1, 3, 5]))

    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(
        "capture.aux_layer_ids: this server captures layers [1, 3, 4]"
    )
    assert engine.calls == []


def test_sglangs_own_refusal_is_a_400_with_its_message(http: TestClient, engine: FakeSGLang) -> None:
    engine.refuse = "The input (5 tokens) is longer than the model's context length"

    response = http.post("/generate", json=capture_body([5, 6, 7, 8, 9], CAPTURE_IDS))

    assert response.status_code == 400
    assert "context length" in response.json()["error"]["message"]


def test_a_server_without_aux_capture_answers_503(http: TestClient, engine: FakeSGLang) -> None:
    engine.unavailable = True

    response = http.post("/generate", json=capture_body([5, 6], CAPTURE_IDS))

    assert response.status_code == 503
    assert "--enable-return-aux-hidden-states" in response.json()["error"]["message"]


# ----------------------------------------------------------------------------------------------------------
# Everything else is stock SGLang


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}}', id="plain-request"),
        pytest.param(b'{"input_ids": [1, 2], "capture": null}', id="capture-null"),
        pytest.param(b'{"text": "say \\"capture\\"", "sampling_params": {}}', id="the-word-in-a-prompt"),
        pytest.param(b'{"input_ids": [1, 2], "capture": {', id="malformed-json"),
    ],
)
def test_requests_without_a_capture_reach_sglang_byte_for_byte(
    http: TestClient, engine: FakeSGLang, raw: bytes
) -> None:
    response = http.post("/generate", content=raw, headers={"content-type": "application/json"})

    assert response.json() == {"stock": True, "body": raw.decode()}
    assert engine.calls == []


def test_model_info_is_sglangs_plus_the_protocols(http: TestClient) -> None:
    for path in ("/get_model_info", "/model_info"):
        answer = http.get(path).json()

        info = ModelInfo.model_validate(answer)
        assert (info.backend, info.num_hidden_layers, info.hidden_size) == ("sglang", 8, H)
        assert answer["capture_aux_layer_ids"] == CAPTURE_IDS and answer["model_path"] == "/models/tiny"


def test_a_server_that_cannot_capture_answers_model_info_as_stock_sglang(http: TestClient, engine: FakeSGLang) -> None:
    # A stock launch of an image with the plugin installed: SGLang's warm-up reads /model_info and must get it.
    engine.unavailable = True

    for path in ("/get_model_info", "/model_info"):
        response = http.get(path)

        assert response.status_code == 200
        assert response.json() == {"stock": True, "model_path": "/models/tiny", "is_generation": True}


def test_the_capture_body_parses_as_the_reference_server_would(http: TestClient) -> None:
    # The same JSON the worker's client sends (shared/capture/client.py: capture).
    body = json.dumps(capture_body([5, 6, 7], CAPTURE_IDS, rid="job-1/shard-0/sample-7", extra_key="0123abcd"))

    response = http.post("/generate", content=body, headers={"content-type": "application/json"})

    assert response.status_code == 200, response.text

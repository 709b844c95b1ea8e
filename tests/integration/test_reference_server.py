"""The reference inference server as a real subprocess with the tiny random Llama, checked against transformers."""

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import Receive, Scope, Send
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from services.inference.reference.engine import ReferenceEngine, compute_dtype
from services.inference.reference.server import create_app
from shared.capture.client import InferenceClient
from shared.capture.protocol import CAPTURE_CONTENT_TYPE, CapturedStates, decode_capture_body
from shared.errors import InferenceProtocolError, InferenceUnavailable
from shared.settings import Settings
from tests.fixtures.processes import free_port

pytestmark = pytest.mark.slow

N_LAYERS, H = 8, 64  # the tiny model's shape
BF16_REL_TOL = 0.02  # relative L2 error between two bf16 computations of the same state


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> PreTrainedModel:
    """The same model in-process, for the reference values."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def client(reference_server_url: str) -> Iterator[InferenceClient]:
    with InferenceClient(reference_server_url, timeout_s=60, max_concurrency=8) as client:
        yield client


@pytest.fixture(scope="module")
def shm_client(reference_server_url: str, reference_shm_dir: Path) -> Iterator[InferenceClient]:
    with InferenceClient(reference_server_url, timeout_s=60, transport="shm", shm_dir=reference_shm_dir) as client:
        yield client


def random_prompt(length: int, seed: int) -> list[int]:
    # Ids from 4 up: 0-3 are the tiny tokenizer's special tokens, and an early end-of-sequence stops decoding.
    return torch.randint(4, 400, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def hf_hidden_states(model: PreTrainedModel, prompt: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(output_hidden_states as [L, H] each, post-norm last_hidden_state [L, H]) from transformers itself."""
    with torch.no_grad():
        input_ids = torch.tensor([prompt])
        hidden_states = model(input_ids, output_hidden_states=True).hidden_states
        final = model.model(input_ids).last_hidden_state
    return [h[0] for h in hidden_states], final[0]


def assert_matches_hf(states: CapturedStates, model: PreTrainedModel, prompt: list[int], layer_ids: list[int]) -> None:
    hidden_states, final = hf_hidden_states(model, prompt)
    assert states.aux_hidden_state.shape == (len(prompt), 3 * H)
    assert states.hidden_state.shape == (len(prompt), H)
    assert states.aux_hidden_state.dtype == states.hidden_state.dtype == torch.bfloat16
    for k, layer_id in enumerate(layer_ids):
        captured = states.aux_hidden_state[:, k * H : (k + 1) * H]
        # Layer j's output is hidden_states[j + 1]. The last layer is left out: transformers 5 stores the
        # post-norm state there, not that layer's residual.
        errors = {j: rel_err(captured, hidden_states[j + 1]) for j in range(N_LAYERS - 1)}
        assert errors[layer_id] < BF16_REL_TOL, f"slice {k} vs layer {layer_id}: {errors}"
        # A plain tolerance cannot catch an off-by-one layer id; the nearest layer must be the requested one.
        assert min(errors, key=errors.__getitem__) == layer_id, f"slice {k} is closest to another layer: {errors}"
    assert rel_err(states.hidden_state, final) < BF16_REL_TOL


def forward_passes(url: str) -> float:
    """How many prefill forwards the server ran so far (the count of its batch-size histogram)."""
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        if family.name == "eagle3_inference_batch_prompts":
            return next(s.value for s in family.samples if s.name.endswith("_count"))
    raise AssertionError("no eagle3_inference_batch_prompts histogram in /metrics")


def test_model_info_describes_the_model(client: InferenceClient, hf_model: PreTrainedModel) -> None:
    info = client.model_info()

    assert (info.num_hidden_layers, info.hidden_size) == (N_LAYERS, H)
    assert info.vocab_size == hf_model.config.vocab_size
    assert info.default_aux_layer_ids == [1, 3, 4]
    assert (info.backend, info.dtype, info.max_context_length) == ("reference", "float32", 1024)  # as configured


@pytest.mark.parametrize("layer_ids", [pytest.param([1, 3, 4], id="default"), pytest.param([0, 3, 6], id="0-3-6")])
def test_captured_states_are_the_requested_layers(
    client: InferenceClient, hf_model: PreTrainedModel, layer_ids: list[int]
) -> None:
    prompt = random_prompt(23, seed=1)

    states = client.capture(prompt, "job-1/shard-0/sample-1", layer_ids)

    assert_matches_hf(states, hf_model, prompt, layer_ids)
    assert states.meta_info["id"] == "job-1/shard-0/sample-1"
    assert states.meta_info["capture"] == {
        "aux_layer_ids": layer_ids,
        "rows": 23,
        "hidden_size": H,
        "dtype": "bfloat16",
    }


def test_both_transports_give_identical_tensors_and_the_shm_file_is_removed(
    client: InferenceClient, shm_client: InferenceClient, reference_shm_dir: Path
) -> None:
    prompt = random_prompt(17, seed=2)

    by_body = client.capture(prompt, "job-1/sample-2", [1, 3, 4])
    by_shm = shm_client.capture(prompt, "job-1/sample-2", [1, 3, 4])

    assert torch.equal(by_body.aux_hidden_state, by_shm.aux_hidden_state)
    assert torch.equal(by_body.hidden_state, by_shm.hidden_state)
    assert by_shm.meta_info["capture"]["path"] == "job-1_sample-2.safetensors"
    assert list(reference_shm_dir.iterdir()) == []


def test_a_batched_request_returns_true_length_rows_equal_to_single_requests(
    reference_server_url: str, client: InferenceClient
) -> None:
    prompts = [random_prompt(length, seed=10 + length) for length in (3, 31, 9)]
    rids = ["batch/0", "batch/1", "batch/2"]

    response = httpx.post(
        f"{reference_server_url}/generate",
        json={
            "input_ids": prompts,
            "rid": rids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "capture": {"aux_layer_ids": [1, 3, 4], "transport": "body"},
        },
        timeout=60,
    )

    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CAPTURE_CONTENT_TYPE
    batched = decode_capture_body(response.content)
    assert [s.meta_info["id"] for s in batched] == rids
    for prompt, rid, states in zip(prompts, rids, batched, strict=True):
        assert states.aux_hidden_state.shape == (len(prompt), 3 * H)  # no padding rows
        assert states.meta_info["capture"]["rows"] == len(prompt)
        single = client.capture(prompt, rid, [1, 3, 4])
        assert rel_err(states.aux_hidden_state, single.aux_hidden_state) < BF16_REL_TOL
        assert rel_err(states.hidden_state, single.hidden_state) < BF16_REL_TOL


def test_concurrent_requests_share_forward_passes_and_keep_their_own_rows(
    reference_server_url: str, client: InferenceClient, hf_model: PreTrainedModel
) -> None:
    requests = [(f"concurrent/{i}", random_prompt(5 + 3 * i, seed=100 + i)) for i in range(8)]
    forwards_before = forward_passes(reference_server_url)

    results = list(client.capture_many(requests, [0, 3, 6]))

    assert forward_passes(reference_server_url) - forwards_before < len(requests)  # some were batched
    assert [s.meta_info["id"] for s in results] == [rid for rid, _ in requests]  # yielded in input order
    for (_, prompt), states in zip(requests, results, strict=True):
        assert_matches_hf(states, hf_model, prompt, [0, 3, 6])


def test_greedy_decoding_equals_transformers_generate(client: InferenceClient, hf_model: PreTrainedModel) -> None:
    prompt = random_prompt(11, seed=3)
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)[0, 11:].tolist()

    answer = client.generate(input_ids=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0})

    assert answer["output_ids"] == expected
    eos = hf_model.generation_config.eos_token_id
    if expected[-1] == eos:
        assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    else:
        assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert answer["meta_info"]["completion_tokens"] == len(expected)

    one = client.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0})
    assert one["output_ids"] == expected[:1]


def decode_calls(url: str) -> float:
    """How many decoding generate calls the server ran so far."""
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        if family.name == "eagle3_inference_decode_batch_prompts":
            return next(s.value for s in family.samples if s.name.endswith("_count"))
    raise AssertionError("no eagle3_inference_decode_batch_prompts histogram in /metrics")


def test_concurrent_greedy_decodes_share_generate_calls_and_equal_unbatched_greedy(
    reference_server_url: str, client: InferenceClient, tiny_model_dir: Path
) -> None:
    # Different lengths (left padding) and different max_new_tokens (each row cut to its own) in one batch.
    prompts = [random_prompt(5 + 7 * i, seed=300 + i) for i in range(6)]
    max_new_tokens = [12, 4, 12, 9, 16, 7]
    one_by_one = [
        client.generate(input_ids=prompt, sampling_params={"max_new_tokens": n, "temperature": 0})
        for prompt, n in zip(prompts, max_new_tokens, strict=True)
    ]
    calls_before = decode_calls(reference_server_url)

    with ThreadPoolExecutor(len(prompts)) as pool:
        batched = list(
            pool.map(
                lambda pn: client.generate(
                    input_ids=pn[0], sampling_params={"max_new_tokens": pn[1], "temperature": 0}
                ),
                zip(prompts, max_new_tokens, strict=True),
            )
        )

    assert decode_calls(reference_server_url) - calls_before < len(prompts)  # some shared a generate call
    assert [b["output_ids"] for b in batched] == [o["output_ids"] for o in one_by_one]
    assert [b["meta_info"]["finish_reason"] for b in batched] == [o["meta_info"]["finish_reason"] for o in one_by_one]
    # And both are transformers' own greedy decoding, in the server's compute dtype.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True, dtype=torch.float32).eval()
    for prompt, n, answer in zip(prompts, max_new_tokens, batched, strict=True):
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)[0, len(prompt) :]
        assert answer["output_ids"] == expected.tolist()
        assert len(answer["output_ids"]) <= n


def test_decoding_stops_at_stop_token_ids(client: InferenceClient, hf_model: PreTrainedModel) -> None:
    prompt = random_prompt(9, seed=4)
    full = client.generate(input_ids=prompt, sampling_params={"max_new_tokens": 6, "temperature": 0})["output_ids"]
    stop = full[3]

    answer = client.generate(
        input_ids=prompt, sampling_params={"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop]}
    )

    assert answer["output_ids"] == full[: full.index(stop) + 1]
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_decoding_from_text_and_seeded_sampling(client: InferenceClient, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = {"max_new_tokens": 5, "temperature": 0.8, "top_p": 0.9, "top_k": 50, "sampling_seed": 7}

    first, second = (client.generate(text=["The capital of", "Hello"], sampling_params=params) for _ in range(2))

    assert [a["meta_info"]["prompt_tokens"] for a in first] == [len(tokenizer("The capital of").input_ids), 1]
    assert all(len(a["output_ids"]) <= 5 for a in first)
    assert [a["output_ids"] for a in first] == [a["output_ids"] for a in second]  # same seed, same tokens


@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param(
            {"input_ids": [5, 6], "capture": {"aux_layer_ids": [1, 3, 8]}}, "capture.aux_layer_ids", id="layer"
        ),
        pytest.param(
            {"input_ids": [5, 6], "capture": {"aux_layer_ids": [1, 3]}}, "capture.aux_layer_ids", id="two-ids"
        ),
        pytest.param({"input_ids": []}, "input_ids", id="empty-prompt"),
        pytest.param({"input_ids": [[5, 6], []]}, "input_ids[1]", id="empty-prompt-in-batch"),
        pytest.param({"input_ids": [5, 10**6]}, "input_ids[1]", id="token-outside-vocab"),
        pytest.param({"input_ids": [5] * 1025}, "max_context_length", id="too-long"),
        pytest.param(
            {"input_ids": [5], "capture": {"aux_layer_ids": [1, 3, 4], "transport": "tcp"}},
            "capture.transport",
            id="transport",
        ),
        pytest.param(
            {"input_ids": [5], "sampling_params": {"stop": ["x"]}}, "sampling_params.stop", id="unknown-param"
        ),
        pytest.param(
            {"input_ids": [5], "sampling_params": {"max_new_tokens": 4}, "capture": {"aux_layer_ids": [1, 3, 4]}},
            "sampling_params.max_new_tokens",
            id="capture-with-decoding",
        ),
        pytest.param({"input_ids": [5], "rid": ["a", "b"]}, "rid", id="rid-list-for-one-prompt"),
    ],
)
def test_bad_requests_get_400_naming_the_field(reference_server_url: str, body: dict, field: str) -> None:
    response = httpx.post(f"{reference_server_url}/generate", json=body, timeout=30)

    assert response.status_code == 400
    assert field in response.json()["error"]["message"]


def test_client_maps_a_rejected_capture_to_a_protocol_error(client: InferenceClient) -> None:
    with pytest.raises(InferenceProtocolError, match=r"rid=job-1/sample-9: 400 capture\.aux_layer_ids: layer id 99"):
        client.capture([5, 6, 7], "job-1/sample-9", [1, 3, 99])


def test_a_dead_server_is_unavailable_quickly() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    with InferenceClient(url, timeout_s=30) as client:
        with pytest.raises(InferenceUnavailable, match=rf"{url}/generate rid=job-1/sample-0"):
            client.capture([5, 6], "job-1/sample-0", [1, 3, 4])
        with pytest.raises(InferenceUnavailable, match="not ready"):
            client.wait_ready(timeout_s=0.5)
    assert time.monotonic() - start < 5


def test_health_is_503_until_the_model_is_loaded(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = Settings(model_path=tiny_model_dir, shm_dir=tmp_path)
    app = create_app(settings, ReferenceEngine(tiny_model_dir, device="cpu"))

    http = TestClient(app)  # outside `with`, the lifespan does not run: the engine never starts loading

    assert http.get("/health").status_code == 503
    response = http.post("/generate", json={"input_ids": [5, 6]})
    assert response.status_code == 503 and "loading" in response.json()["error"]["message"]


@contextmanager
def server_in_thread(
    tiny_model_dir: Path, shm_dir: Path, port: int, paths: list[str] | None = None
) -> Iterator[ReferenceEngine]:
    """The reference server in this process, on `port`, its model loading in the background; the path of every
    request it receives is appended to `paths`."""
    engine = ReferenceEngine(tiny_model_dir, device="cpu", max_batch_wait_ms=0)
    app = create_app(Settings(model_path=tiny_model_dir, shm_dir=shm_dir), engine)

    async def recorded(scope: Scope, receive: Receive, send: Send) -> None:
        if paths is not None and scope["type"] == "http":
            paths.append(scope["path"])
        await app(scope, receive, send)

    server = uvicorn.Server(uvicorn.Config(recorded, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield engine
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_wait_ready_waits_for_a_server_that_is_still_loading(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    with (
        server_in_thread(tiny_model_dir, tmp_path, port) as engine,
        InferenceClient(f"http://127.0.0.1:{port}", timeout_s=30) as client,
    ):
        assert not engine.ready  # the client starts waiting before the server listens or the model loads

        client.wait_ready(timeout_s=60)

        assert engine.ready
        assert client.capture([5, 6, 7], "after-ready", [1, 3, 4]).hidden_state.shape == (3, H)


def test_a_server_that_answered_is_not_polled_on_health_until_a_request_finds_it_gone(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SGLang's /health answers a second later at the earliest: each job's first shard on each worker paid it."""
    port, paths = free_port(), []
    with InferenceClient(f"http://127.0.0.1:{port}", timeout_s=30) as client:
        with server_in_thread(tiny_model_dir, tmp_path, port, paths):
            client.wait_ready(timeout_s=60)
            assert "/health" in paths
            client.capture([5, 6, 7], "first-job", [1, 3, 4])

            paths.clear()
            client.wait_ready(timeout_s=60)  # the next job's first shard
            assert paths == ["/get_model_info"]

        # Gone: its model info does not answer, so /health is polled, until the deadline.
        with pytest.raises(InferenceUnavailable, match="not ready"):
            client.wait_ready(timeout_s=0.5)
        with pytest.raises(InferenceUnavailable):
            client.capture([5, 6, 7], "while-gone", [1, 3, 4])

        paths.clear()
        with server_in_thread(tiny_model_dir, tmp_path, port, paths) as engine:
            client.wait_ready(timeout_s=60)  # a request found it unavailable: it waits on /health again
            assert engine.ready and paths[0] == "/health" and "/get_model_info" not in paths
            assert client.capture([5, 6, 7], "restarted", [1, 3, 4]).hidden_state.shape == (3, H)


@pytest.mark.parametrize(("native_bf16", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_compute_dtype_is_bf16_only_where_the_cpu_computes_it_natively(
    monkeypatch: pytest.MonkeyPatch, native_bf16: bool, expected: torch.dtype
) -> None:
    monkeypatch.setattr("services.inference.reference.engine._cpu_has_native_bf16", lambda: native_bf16)
    assert compute_dtype("auto", torch.device("cpu")) == expected
    assert compute_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert compute_dtype("float32", torch.device("cuda")) == torch.float32

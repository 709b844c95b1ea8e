"""The capture-protocol conformance suite: what the worker relies on, checked against any inference server.

Against a running server (an SGLang container with the plugin, or a reference server elsewhere):

    pytest tests/conformance --inference-url http://gpu-host:30000 \
        [--model-path /models/target] [--shm-dir /dev/shm/eagle3]

or the same through EAGLE3_CONFORMANCE_URL, EAGLE3_CONFORMANCE_MODEL_PATH and EAGLE3_CONFORMANCE_SHM_DIR.
`--model-path` (a local Hugging Face folder of the served model) enables the value checks against transformers;
`--shm-dir` (the server's shared directory as mounted where the suite runs) enables the "shm" transport tests.
EAGLE3_CONFORMANCE_HF_DEVICE (default cpu) is where transformers computes the reference states.
Without a URL the suite starts the reference server on the tiny random Llama (or on `--model-path`), and both
are known.

The options are registered when this directory is on the command line; in a whole-suite run they are absent
and `_setting` falls back to the environment, then to the local reference server.
"""

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.capture.client import InferenceClient
from shared.capture.protocol import ModelInfo
from tests.conformance.hf_reference import HFReference
from tests.fixtures.reference_server import run_reference_server

REQUEST_TIMEOUT_S = 120.0


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "capture-protocol conformance suite (tests/conformance)")
    group.addoption("--inference-url", default=None, help="base URL of the server under test (else: a local one)")
    group.addoption("--model-path", default=None, help="local Hugging Face folder of the served model")
    group.addoption("--shm-dir", default=None, help="the server's shared directory as mounted here")


def _setting(config: pytest.Config, option: str, env: str) -> str | None:
    value = config.getoption(option, default=None) or os.environ.get(env)
    return value or None


@dataclass(frozen=True)
class ServerUnderTest:
    url: str
    model_path: Path | None  # known: the value checks run
    shm_dir: Path | None  # known: the "shm" transport tests run
    local: bool  # started by the suite (a reference server)


@pytest.fixture(scope="session")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerUnderTest]:
    config = request.config
    url = _setting(config, "--inference-url", "EAGLE3_CONFORMANCE_URL")
    model_path = _setting(config, "--model-path", "EAGLE3_CONFORMANCE_MODEL_PATH")
    shm_dir = _setting(config, "--shm-dir", "EAGLE3_CONFORMANCE_SHM_DIR")
    if url is not None:
        yield ServerUnderTest(
            url.rstrip("/"), Path(model_path) if model_path else None, Path(shm_dir) if shm_dir else None, False
        )
    elif model_path is not None:
        local_shm = tmp_path_factory.mktemp("conformance-shm")
        with run_reference_server(Path(model_path), shm_dir=local_shm) as local_url:
            yield ServerUnderTest(local_url, Path(model_path), local_shm, True)
    else:
        yield ServerUnderTest(
            request.getfixturevalue("reference_server_url"),
            request.getfixturevalue("tiny_model_dir"),
            request.getfixturevalue("reference_shm_dir"),
            True,
        )


@pytest.fixture(scope="session")
def client(server: ServerUnderTest) -> Iterator[InferenceClient]:
    with InferenceClient(server.url, timeout_s=REQUEST_TIMEOUT_S, max_concurrency=4) as client:
        client.wait_ready(timeout_s=REQUEST_TIMEOUT_S)
        yield client


@pytest.fixture(scope="session")
def shm_client(server: ServerUnderTest) -> Iterator[InferenceClient]:
    if server.shm_dir is None:
        pytest.skip("transport 'shm' needs --shm-dir: the server's shared directory as mounted where the suite runs")
    with InferenceClient(server.url, timeout_s=REQUEST_TIMEOUT_S, transport="shm", shm_dir=server.shm_dir) as client:
        yield client


@pytest.fixture(scope="session")
def model_info(client: InferenceClient) -> ModelInfo:
    return client.model_info()


@pytest.fixture(scope="session")
def model_info_json(server: ServerUnderTest) -> dict[str, Any]:
    """The raw /get_model_info answer (with fields ModelInfo does not model)."""
    return httpx.get(f"{server.url}/get_model_info", timeout=REQUEST_TIMEOUT_S).json()


@pytest.fixture(scope="session")
def hf(server: ServerUnderTest) -> HFReference:
    if server.model_path is None:
        pytest.skip("value checks need --model-path: a local Hugging Face folder of the served model")
    return HFReference(server.model_path, device=os.environ.get("EAGLE3_CONFORMANCE_HF_DEVICE", "cpu"))

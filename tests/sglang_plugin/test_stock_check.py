"""stock_check.py: it passes a stock server that runs the plugin's middleware, and catches one without it."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import stock_check
from eagle3_sglang_plugin.http import BackendUnavailable, CaptureMiddleware
from eagle3_sglang_plugin.protocol import ModelLimits
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient


class NoAuxCapture:
    """The plugin's backend on a server launched without aux capture (hooks.SGLangBackend's answer)."""

    shm_dir = Path("/nonexistent")

    def limits(self) -> ModelLimits:
        raise BackendUnavailable("launched without --enable-return-aux-hidden-states --speculative-algorithm EAGLE3")

    async def generate(self, kwargs: dict[str, Any], request: Request) -> Any:
        raise AssertionError("a server that cannot capture never reaches the engine")

    async def model_info(self) -> dict[str, Any]:
        raise BackendUnavailable("no aux capture")


async def stock_generate(request: Request) -> Response:
    """SGLang's own /generate: it ignores fields it does not know, `capture` included, and decodes."""
    body = await request.json()
    return JSONResponse({"output_ids": [7, 8], "meta_info": {"prompt_tokens": len(body["input_ids"])}})


async def stock_model_info(request: Request) -> Response:
    return JSONResponse({"model_path": "/models/tiny", "is_generation": True})


def stock_app() -> Starlette:
    return Starlette(
        routes=[
            Route("/generate", stock_generate, methods=["POST"]),
            *(Route(path, stock_model_info) for path in ("/get_model_info", "/model_info")),
        ]
    )


@pytest.fixture
def with_plugin() -> Iterator[TestClient]:
    app = stock_app()
    app.add_middleware(CaptureMiddleware, backend=NoAuxCapture())
    with TestClient(app) as client:
        yield client


def test_a_stock_server_with_the_plugin_passes(with_plugin: TestClient) -> None:
    checks = stock_check.run_checks(with_plugin)

    assert [c.ok for c in checks] == [True, True, True, True], checks


def test_a_server_without_the_plugin_fails_the_capture_check() -> None:
    with TestClient(stock_app()) as client:
        checks = stock_check.run_checks(client)

    assert [c.ok for c in checks] == [True, True, True, False]
    assert "plugin is not loaded" in checks[-1].detail

"""The reference inference server: SGLang's /health, /get_model_info and /generate, plus the capture extension.

The routes parse, hand the work to ReferenceEngine, and translate results and errors into the capture
protocol (docs/capture-protocol.md). The model loads in the engine thread after the server starts, so
/health answers 503 while it loads.
"""

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.inference.reference.engine import EngineUnavailable, PromptResult, ReferenceEngine
from shared.capture.protocol import (
    CAPTURE_CONTENT_TYPE,
    CapturedStates,
    GenerateRequest,
    InvalidRequest,
    ModelInfo,
    capture_file_name,
    encode_capture_body,
    request_ids,
    write_capture_file,
)
from shared.errors import ConfigurationError
from shared.settings import Settings

logger = logging.getLogger(__name__)

# Workers keep one connection per in-flight request; keep it open between samples.
_KEEP_ALIVE_S = 75


def get_engine(request: Request) -> ReferenceEngine:
    return request.app.state.engine


def get_shm_dir(request: Request) -> Path:
    return request.app.state.settings.shm_dir


EngineDep = Annotated[ReferenceEngine, Depends(get_engine)]
ShmDirDep = Annotated[Path, Depends(get_shm_dir)]

router = APIRouter()


@router.get("/health")
def health(engine: EngineDep) -> Response:
    if engine.ready:
        return Response(status_code=200)
    if engine.load_error is not None:
        return _error(503, f"model {engine.model_path} failed to load: {engine.load_error}")
    return _error(503, f"model {engine.model_path} is loading" if not engine.wait_loaded(0) else "shutting down")


@router.get("/get_model_info")
def get_model_info(engine: EngineDep) -> ModelInfo:
    return engine.model_info


@router.get("/metrics")
def metrics(engine: EngineDep) -> Response:
    return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/generate", response_model=None)
async def generate(body: GenerateRequest, engine: EngineDep, shm_dir: ShmDirDep) -> Response:
    prompts, is_batch = _prompts(body, engine)
    rids = request_ids(body.rid, len(prompts), is_batch)
    engine.check(prompts, is_batch, body.sampling_params, body.capture)
    results = await asyncio.wrap_future(engine.submit(prompts, body.sampling_params, body.capture))
    return await _respond(body, engine, shm_dir, prompts, rids, results, is_batch)


# ----------------------------------------------------------------------------------------------------------
# Request parsing and response assembly


def _prompts(body: GenerateRequest, engine: ReferenceEngine) -> tuple[list[list[int]], bool]:
    """(prompts as token ids, whether the request is a batch)."""
    if body.input_ids is not None:
        if body.input_ids and isinstance(body.input_ids[0], list):
            return body.input_ids, True
        # The ignore: not a batch, so a list of ints (the validator allows no mixed lists); mypy cannot tell.
        return [body.input_ids], False  # type: ignore[list-item]
    assert body.text is not None
    texts = [body.text] if isinstance(body.text, str) else body.text
    prompts = [engine.tokenizer(text).input_ids for text in texts]
    return prompts, not isinstance(body.text, str)


async def _respond(
    body: GenerateRequest,
    engine: ReferenceEngine,
    shm_dir: Path,
    prompts: list[list[int]],
    rids: list[str],
    results: list[PromptResult],
    is_batch: bool,
) -> Response:
    info = engine.model_info
    outputs: list[dict[str, Any]] = []
    for rid, prompt, result in zip(rids, prompts, results, strict=True):
        meta_info: dict[str, Any] = {
            "id": rid,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(result.output_ids),
            "finish_reason": result.finish_reason,
        }
        if body.capture is not None:
            assert result.captured is not None
            meta_info["capture"] = {
                "aux_layer_ids": body.capture.aux_layer_ids,
                "rows": result.captured.hidden_state.shape[0],
                "hidden_size": info.hidden_size,
                "dtype": "bfloat16",
            }
            result.captured.meta_info = meta_info
        text = engine.tokenizer.decode(result.output_ids, skip_special_tokens=body.sampling_params.skip_special_tokens)
        outputs.append({"text": text, "output_ids": result.output_ids, "meta_info": meta_info})

    engine.metrics.requests.labels(kind="capture" if body.capture is not None else "generate").inc()
    engine.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
    engine.metrics.generated_tokens.inc(sum(len(r.output_ids) for r in results))

    if body.capture is not None:
        states = [result.captured for result in results if result.captured is not None]
        if body.capture.transport == "body":
            # Encoding copies tens of MB: off the event loop.
            content = await run_in_threadpool(encode_capture_body, states)
            return Response(memoryview(content), media_type=CAPTURE_CONTENT_TYPE)
        paths = await run_in_threadpool(_write_capture_files, shm_dir, rids, states)
        for output, path in zip(outputs, paths, strict=True):
            output["meta_info"]["capture"]["path"] = path
    return JSONResponse(outputs if is_batch else outputs[0])


def _write_capture_files(shm_dir: Path, rids: list[str], states: list[CapturedStates]) -> list[str]:
    """Write one file per prompt; returns names relative to the shared directory (the worker mounts it elsewhere)."""
    names = [capture_file_name(rid) for rid in rids]
    for name, state in zip(names, states, strict=True):
        write_capture_file(shm_dir, name, state)
    return names


def _error(status_code: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status_code)


# ----------------------------------------------------------------------------------------------------------
# Application


def create_app(settings: Settings, engine: ReferenceEngine | None = None) -> FastAPI:
    """The server's app; the engine (built from settings unless given) starts loading when the app starts."""
    engine = engine if engine is not None else ReferenceEngine.from_settings(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.shm_dir.mkdir(parents=True, exist_ok=True)
        engine.start()
        try:
            yield
        finally:
            await run_in_threadpool(engine.close)

    app = FastAPI(title="EAGLE-3 reference inference server", lifespan=lifespan)
    app.state.engine = engine
    app.state.settings = settings
    app.include_router(router)

    @app.exception_handler(RequestValidationError)
    async def malformed_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # SGLang answers 400 for a malformed request; FastAPI's default would be 422.
        engine.metrics.errors.labels(reason="bad_request").inc()
        return _error(400, str(InvalidRequest.from_validation_errors(exc.errors())))

    @app.exception_handler(InvalidRequest)
    async def invalid_request(request: Request, exc: InvalidRequest) -> JSONResponse:
        engine.metrics.errors.labels(reason="bad_request").inc()
        return _error(400, str(exc))

    @app.exception_handler(EngineUnavailable)
    async def unavailable(request: Request, exc: EngineUnavailable) -> JSONResponse:
        engine.metrics.errors.labels(reason="unavailable").inc()
        return _error(503, str(exc))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        engine.metrics.errors.labels(reason="internal").inc()
        logger.error("%s %s failed: %r", request.method, request.url.path, exc)
        return _error(500, f"internal error: {exc!r}")

    return app


def serve(settings: Settings) -> None:
    """Run the reference server on settings.inference_host:inference_port until stopped."""
    engine = ReferenceEngine.from_settings(settings)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings, engine),
            host=settings.inference_host,
            port=settings.inference_port,
            timeout_keep_alive=_KEEP_ALIVE_S,
        )
    )

    def stop_if_load_fails() -> None:
        # A server that can never load its model should exit with the reason, not answer 503 forever.
        engine.wait_loaded()
        if engine.load_error is not None:
            server.should_exit = True

    threading.Thread(target=stop_if_load_fails, name="load-watchdog", daemon=True).start()
    server.run()
    if engine.load_error is not None:
        raise ConfigurationError(f"model {settings.model_path} failed to load: {engine.load_error}") from (
            engine.load_error
        )

"""An ASGI middleware in front of SGLang's FastAPI app: serves capture requests, passes everything else through.

Why a middleware and not a route: SGLang v0.5.23's `/generate` (`python/sglang/srt/entrypoints/http_server.py:
generate_request`) parses the body into `GenerateReqInput`, a dataclass without our `capture` field, and its
`api_contract` check ignores unknown keys, so a capture request would silently run as a plain one. The middleware
reads the body of `POST /generate` once; a body without `capture` is replayed byte for byte to SGLang's own
route (stock behaviour, errors included), a body with it is served here through SGLang's tokenizer manager.

Nothing here imports SGLang: the SGLang side is the `CaptureBackend` (`hooks.SGLangBackend`), so the middleware
is tested with a stand-in backend.
"""

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any, Protocol

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from shared.capture_protocol import CAPTURE_CONTENT_TYPE, CapturedStates, encode_capture_body, read_capture_file

from .protocol import BadRequest, CaptureFailed, CapturePlan, ModelLimits, plan_capture, protocol_outputs
from .protocol import sglang_generate_kwargs as build_generate_kwargs

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

GENERATE_PATH = "/generate"
MODEL_INFO_PATHS = ("/get_model_info", "/model_info")


class BackendUnavailable(RuntimeError):
    """The server cannot take capture requests yet, or at all (HTTP 503); the message says why."""


class CaptureBackend(Protocol):
    """What the middleware needs from the inference engine."""

    shm_dir: Path

    def limits(self) -> ModelLimits:
        """The model's limits; raises BackendUnavailable while the server cannot capture."""
        ...

    async def generate(self, kwargs: dict[str, Any], request: Request) -> Any:
        """Run a `GenerateReqInput(**kwargs)`; the engine's answer (a list for a batch); ValueError = bad request."""
        ...

    async def model_info(self) -> dict[str, Any]:
        """The full `/get_model_info` answer."""
        ...


class CaptureMiddleware:
    def __init__(self, app: ASGIApp, backend: CaptureBackend) -> None:
        self.app = app
        self.backend = backend

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if path in MODEL_INFO_PATHS and method == "GET":
            await self._model_info()(scope, receive, send)
            return
        if path != GENERATE_PATH or method not in ("POST", "PUT"):
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        replay = _replaying(body, receive)
        capture_body = _capture_body(body)
        if capture_body is None:
            await self.app(scope, replay, send)  # stock SGLang, byte for byte
            return
        response = await self._capture(Request(scope, replay), capture_body)
        await response(scope, replay, send)

    def _model_info(self) -> "_Deferred":
        async def answer() -> Response:
            try:
                return JSONResponse(await self.backend.model_info())
            except BackendUnavailable as exc:
                return _error(503, str(exc))

        return _Deferred(answer)

    async def _capture(self, request: Request, body: dict[str, Any]) -> Response:
        try:
            plan = plan_capture(body, self.backend.limits())
        except BadRequest as exc:
            return _error(400, str(exc))
        except BackendUnavailable as exc:
            return _error(503, str(exc))
        try:
            answer = await self.backend.generate(build_generate_kwargs(plan), request)
            outputs = protocol_outputs(plan, answer)
            if plan.transport == "body":
                content = await run_in_threadpool(_encode_body, self.backend.shm_dir, plan, outputs)
                return Response(memoryview(content), media_type=CAPTURE_CONTENT_TYPE)
        except ValueError as exc:  # SGLang's own request checks raise ValueError (its /generate answers 400)
            await run_in_threadpool(_remove_files, self.backend.shm_dir, plan.file_names)
            return _error(400, str(exc))
        except CaptureFailed as exc:
            await run_in_threadpool(_remove_files, self.backend.shm_dir, plan.file_names)
            return _error(500, str(exc))
        except Exception as exc:
            logger.exception("capture request rids=%s failed", ",".join(plan.rids))
            await run_in_threadpool(_remove_files, self.backend.shm_dir, plan.file_names)
            return _error(500, f"internal error: {exc!r}")
        logger.debug("captured rids=%s transport=shm", ",".join(plan.rids))
        return JSONResponse(outputs if plan.is_batch else outputs[0])


def _encode_body(shm_dir: Path, plan: CapturePlan, outputs: list[dict[str, Any]]) -> bytearray:
    """Read the spooled files back into one "body" response, and delete them whatever happens."""
    try:
        states = []
        for name, output in zip(plan.file_names, outputs, strict=True):
            aux_hidden_state, hidden_state = read_capture_file(shm_dir / name)
            states.append(CapturedStates(aux_hidden_state, hidden_state, output["meta_info"]))
        return encode_capture_body(states)
    finally:
        _remove_files(shm_dir, plan.file_names)


def _remove_files(shm_dir: Path, names: list[str]) -> None:
    for name in names:
        (shm_dir / name).unlink(missing_ok=True)


def _capture_body(body: bytes) -> dict[str, Any] | None:
    """The parsed body when it asks for a capture; None sends the request to SGLang unchanged."""
    if b'"capture"' not in body:  # cheap test first: most plain requests never get parsed twice
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None  # SGLang answers malformed JSON in its own words
    if isinstance(parsed, dict) and parsed.get("capture") is not None:
        return parsed
    return None


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands out the already-read body once, then the client's own messages (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class _Deferred:
    """An ASGI app that builds its response when called (so errors become responses, not exceptions)."""

    def __init__(self, build: Callable[[], Awaitable[Response]]) -> None:
        self.build = build

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.build()
        await response(scope, receive, send)


def _error(status_code: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status_code)

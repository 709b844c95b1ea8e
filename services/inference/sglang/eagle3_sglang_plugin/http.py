"""An ASGI middleware in front of SGLang's FastAPI app: serves capture requests, passes everything else through.

Why a middleware and not a route: SGLang v0.5.23's `/generate` (`python/sglang/srt/entrypoints/http_server.py:
generate_request`) parses the body into `GenerateReqInput`, a dataclass without our `capture` field, and its
`api_contract` check ignores unknown keys, so a capture request would silently run as a plain one. The middleware
reads the body of `POST /generate` once; a body without `capture` is replayed byte for byte to SGLang's own
route (stock behaviour, errors included), a body with it is served here through SGLang's tokenizer manager.

Nothing here imports SGLang: the SGLang side is the `CaptureBackend` (`hooks.SGLangBackend`), so the middleware
is tested with a stand-in backend.
"""

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any, Protocol

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from shared.capture.protocol import (
    CAPTURE_CONTENT_TYPE,
    CapturedStates,
    InvalidRequest,
    encode_capture_body,
    read_capture_file,
)

from .capture import error_file_name
from .protocol import CaptureFailed, CapturePlan, ModelLimits, plan_capture, protocol_outputs
from .protocol import sglang_generate_kwargs as build_generate_kwargs

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

GENERATE_PATH = "/generate"
MODEL_INFO_PATHS = ("/get_model_info", "/model_info")
# How long an answered capture may take to appear in the shared directory (the scheduler's writer threads write it
# after SGLang answered): far above a write's real duration, which is well under a second for 64 MB.
WRITE_TIMEOUT_S = 300.0
_POLL_S = 0.002


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
            await self._model_info(self.app)(scope, receive, send)
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

    def _model_info(self, stock: ASGIApp) -> ASGIApp:
        """The protocol's model info; SGLang's own where this server does not capture.

        A stock launch of an image with the plugin installed is then stock SGLang (its warm-up reads
        `/model_info`); only capture requests are answered 503 with the reason.
        """

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            try:
                response: Response = JSONResponse(await self.backend.model_info())
            except BackendUnavailable:
                await stock(scope, receive, send)
                return
            await response(scope, receive, send)

        return app

    async def _capture(self, request: Request, body: dict[str, Any]) -> Response:
        try:
            plan = plan_capture(body, self.backend.limits())
        except InvalidRequest as exc:
            return _error(400, str(exc))
        except BackendUnavailable as exc:
            return _error(503, str(exc))
        try:
            answer = await self.backend.generate(build_generate_kwargs(plan), request)
            outputs = protocol_outputs(plan, answer)
            await wait_until_written(self.backend.shm_dir, plan.file_names, WRITE_TIMEOUT_S)
            if plan.transport == "body":
                content = await run_in_threadpool(_encode_body, self.backend.shm_dir, plan, outputs)
                return Response(memoryview(content), media_type=CAPTURE_CONTENT_TYPE)
        except ValueError as exc:  # SGLang's own request checks raise ValueError (its /generate answers 400)
            await self._discard(plan)
            return _error(400, str(exc))
        except CaptureFailed as exc:
            await self._discard(plan)
            return _error(500, str(exc))
        except Exception as exc:
            logger.exception("capture request rids=%s failed", ",".join(plan.rids))
            await self._discard(plan)
            return _error(500, f"internal error: {exc!r}")
        logger.debug("captured rids=%s transport=shm", ",".join(plan.rids))
        return JSONResponse(outputs if plan.is_batch else outputs[0])

    async def _discard(self, plan: CapturePlan) -> None:
        """Remove a failed request's files, now and once more after the writer threads are surely done with
        the other prompts of its batch."""
        shm_dir, names = self.backend.shm_dir, plan.file_names
        await run_in_threadpool(_remove_files, shm_dir, names)
        asyncio.get_running_loop().call_later(WRITE_TIMEOUT_S, _remove_files, shm_dir, names)


async def wait_until_written(shm_dir: Path, names: list[str], timeout_s: float) -> None:
    """Return once every file is in place; raise CaptureFailed with the writer's reason (or the wait's)."""
    deadline = time.monotonic() + timeout_s
    for name in names:
        path, error_path = shm_dir / name, shm_dir / error_file_name(name)
        while not path.exists():
            if error_path.exists():
                reason = error_path.read_text()
                error_path.unlink(missing_ok=True)
                raise CaptureFailed(reason)
            if time.monotonic() > deadline:
                raise CaptureFailed(f"capture file {name} was not written within {timeout_s:.0f} s")
            await asyncio.sleep(_POLL_S)


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
        (shm_dir / error_file_name(name)).unlink(missing_ok=True)


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


def _error(status_code: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status_code)

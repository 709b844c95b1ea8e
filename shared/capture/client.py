"""The worker's side of the capture protocol (docs/capture-protocol.md): one keep-alive httpx client.

A hung server (a stopped process, a deadlocked engine: TCP still accepts, nothing answers) is found sooner than the
per-request timeout, which must stay long for a slow prefill: while requests are outstanding a watch probes the
server's /health on a connection of its own, and a request is abandoned once /health has not answered for
`health_timeout_s` (EAGLE3_INFERENCE_HEALTH_TIMEOUT_S). A slow request of a server that answers /health is waited for.

Errors are split by what a retry can fix:
- InferenceUnavailable (transient): nothing listening, a timeout, a dropped connection, a 5xx answer, a hung server.
- InferenceProtocolError (not transient): a 4xx answer, or a 2xx answer that does not follow the protocol.
This module decodes faithfully and does not check rows, dtype or values against the prompt: the caller does.
"""

import functools
import logging
import ssl
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

import httpx
from pydantic import ValidationError

from shared.capture.protocol import (
    CAPTURE_CONTENT_TYPE,
    CapturedStates,
    ModelInfo,
    decode_capture_body,
    read_capture_file,
)
from shared.errors import InferenceProtocolError, InferenceUnavailable
from shared.settings import Settings

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 10.0
_HEALTH_POLL_INTERVAL_S = 0.25
_HEALTH_PROBE_INTERVAL_S = 5.0  # at most; a quarter of the health timeout when that is shorter

T = TypeVar("T")


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One TLS context for every client of this process. httpx builds a new one per client otherwise (about 50 ms
    of CPU, the CA bundle parsed again), which the health watch would pay each time requests become outstanding."""
    return httpx.create_ssl_context()


class HealthWatch:
    """Probes a server's /health on a connection of its own while requests are outstanding (`outstanding()`), and
    says how long it has gone without an answer. Any HTTP answer counts: a server that answers is not hung."""

    def __init__(self, base_url: str, probe_interval_s: float) -> None:
        self.base_url = base_url
        self.probe_interval_s = probe_interval_s
        self._lock = threading.Lock()
        self._outstanding = 0
        self._thread: threading.Thread | None = None
        self._last_answer = self._busy_since = time.monotonic()

    @contextmanager
    def outstanding(self) -> Iterator[None]:
        with self._lock:
            if self._outstanding == 0:
                self._busy_since = time.monotonic()  # silence before this request does not count against it
            self._outstanding += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._probe, name="inference-health", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._outstanding -= 1

    def silent_s(self) -> float:
        """Since the last answer, or since requests became outstanding if that is later."""
        return time.monotonic() - max(self._last_answer, self._busy_since)

    def _probe(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=self.probe_interval_s, verify=tls_context()) as http:
            while True:
                with self._lock:
                    if self._outstanding == 0:
                        self._thread = None
                        return
                started = time.monotonic()
                try:
                    http.get("/health")
                    self._last_answer = time.monotonic()
                except httpx.HTTPError:
                    pass  # no answer (refused, timed out): silence goes on
                time.sleep(max(self.probe_interval_s - (time.monotonic() - started), 0.0))


class InferenceClient:
    """Capture and decoding requests to one inference server, with at most `max_concurrency` in flight."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 300.0,
        health_timeout_s: float = 60.0,
        max_concurrency: int = 4,
        transport: Literal["body", "shm"] = "body",
        shm_dir: Path | None = None,
    ) -> None:
        if transport == "shm" and shm_dir is None:
            raise ValueError("transport 'shm' needs shm_dir, the worker's mount of the server's shared directory")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.health_timeout_s = health_timeout_s
        self.max_concurrency = max_concurrency
        self.transport = transport
        self.shm_dir = shm_dir
        self._health = HealthWatch(self.base_url, min(_HEALTH_PROBE_INTERVAL_S, health_timeout_s / 4))
        self._answered = False  # the server answered, and no request has found it unavailable since
        self._http_lock = threading.Lock()
        self._http = self._new_http()

    def _new_http(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url,
            # A prefill of a long prompt may take a while; connecting should not.
            timeout=httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, _CONNECT_TIMEOUT_S)),
            # One kept-alive connection per in-flight request, so that no request waits for a connection.
            limits=httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency),
            verify=tls_context(),
        )

    @classmethod
    def from_settings(cls, settings: Settings, url: str | None = None) -> "InferenceClient":
        """A client of the worker's own server, or of another one at `url` (over the body: a shared-memory hand-off
        needs the server on this host, which only the worker's own is known to be)."""
        own = url is None or url == settings.inference_url
        return cls(
            settings.inference_url if url is None else url,
            timeout_s=settings.inference_timeout_s,
            health_timeout_s=settings.inference_health_timeout_s,
            max_concurrency=settings.inference_concurrency,
            transport=settings.capture_transport if own else "body",
            shm_dir=settings.shm_dir,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------------
    # Server state

    def model_info(self) -> ModelInfo:
        response = self._request("GET", "/get_model_info", rid=None)
        try:
            return ModelInfo.model_validate(response.json())
        except (ValueError, ValidationError) as exc:
            raise InferenceProtocolError(f"{self.base_url}/get_model_info: not a model info answer: {exc}") from exc

    def wait_ready(self, timeout_s: float) -> None:
        """Poll /health until it answers 200; connection errors and 503 mean "not yet" until the deadline.

        A server that has answered this client, with no request finding it unavailable since, is asked for its model
        info instead, which it answers at once: SGLang's /health runs a one-token generation and answers a second
        later at the earliest, a second that every job's first shard paid on every worker (a tenth of a 10-second job
        at 8B shape). Only if that does not answer is /health polled."""
        if self._answered:
            if self._answers_model_info():
                return
            self._answered = False
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_s = deadline - time.monotonic()
            try:
                response = self._http.get("/health", timeout=max(min(remaining_s, _CONNECT_TIMEOUT_S), 0.1))
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code == 200:
                    logger.info("inference server %s ready", self.base_url)
                    self._answered = True
                    return
                if response.status_code != 503:
                    raise InferenceProtocolError(
                        f"{self.base_url}/health answered {response.status_code}: {_error_message(response)}"
                    )
                last = f"503 {_error_message(response)}"
            if remaining_s <= 0:
                raise InferenceUnavailable(f"{self.base_url} not ready after {timeout_s:.0f}s; last answer: {last}")
            time.sleep(min(_HEALTH_POLL_INTERVAL_S, max(remaining_s, 0)))

    def _answers_model_info(self) -> bool:
        try:
            response = self._http.get("/get_model_info", timeout=_CONNECT_TIMEOUT_S)
        except httpx.TransportError:
            return False
        return response.status_code == 200

    # ------------------------------------------------------------------------------------------------------
    # Capture

    def capture(self, input_ids: list[int], rid: str, aux_layer_ids: list[int]) -> CapturedStates:
        """Prefill one prompt and return its captured states (bf16 [L, 3H] and [L, H]) and meta_info."""
        body = {
            "input_ids": input_ids,
            "rid": rid,
            # A fresh prefix-cache key per request: a cache hit on SGLang would capture fewer rows.
            "extra_key": uuid.uuid4().hex,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "capture": {"aux_layer_ids": aux_layer_ids, "transport": self.transport},
        }
        if self.transport == "body":
            return self._capture_body(body, rid)
        return self._capture_shm(body, rid)

    def capture_many(self, requests: list[tuple[str, list[int]]], aux_layer_ids: list[int]) -> Iterator[CapturedStates]:
        """Capture (rid, input_ids) pairs, yielding in input order, at most max_concurrency requests in flight.

        The server batches concurrent requests. Up to max_concurrency finished results wait in order behind a
        slow one, so the server stays busy without unbounded buffering. An error is raised when its result's
        turn comes; requests not yet sent are then cancelled.
        """
        pending = deque(requests)
        in_order: deque[Future[CapturedStates]] = deque()
        with ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="capture") as pool:
            try:
                while pending or in_order:
                    while pending and len(in_order) < 2 * self.max_concurrency:
                        rid, input_ids = pending.popleft()
                        in_order.append(pool.submit(self.capture, input_ids, rid, aux_layer_ids))
                    yield in_order.popleft().result()
            finally:
                for future in in_order:
                    future.cancel()

    def _capture_body(self, body: dict[str, Any], rid: str) -> CapturedStates:
        def call(http: httpx.Client) -> bytearray:
            with self._stream(http, "POST", "/generate", rid=rid, json=body) as response:
                content_type = response.headers.get("content-type", "")
                if not content_type.startswith(CAPTURE_CONTENT_TYPE):
                    raise InferenceProtocolError(
                        f"{self.base_url}/generate rid={rid}: answered {content_type or 'no content type'}, not "
                        f"{CAPTURE_CONTENT_TYPE}; does the server implement the capture extension?"
                    )
                return self._read_body(response)

        content = self._watched(call, "/generate", rid)
        try:
            states = decode_capture_body(content)
        except InferenceProtocolError as exc:
            raise InferenceProtocolError(f"{self.base_url}/generate rid={rid}: {exc}") from exc
        if len(states) != 1:
            raise InferenceProtocolError(f"{self.base_url}/generate rid={rid}: {len(states)} captures for one prompt")
        return states[0]

    def _capture_shm(self, body: dict[str, Any], rid: str) -> CapturedStates:
        assert self.shm_dir is not None  # checked in __init__
        answer = self._json(self._request("POST", "/generate", rid=rid, json=body), rid)
        try:
            meta_info = answer["meta_info"]
            name = meta_info["capture"]["path"]
        except (KeyError, TypeError) as exc:
            raise InferenceProtocolError(
                f"{self.base_url}/generate rid={rid}: shm answer without meta_info.capture.path: {answer!r:.300}"
            ) from exc
        relative = PurePosixPath(name) if isinstance(name, str) else None
        if relative is None or relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise InferenceProtocolError(
                f"{self.base_url}/generate rid={rid}: capture path {name!r} is not a name inside the shared directory"
            )
        path = self.shm_dir / relative
        try:
            aux_hidden_state, hidden_state = read_capture_file(path)
        except FileNotFoundError as exc:
            raise InferenceProtocolError(
                f"{self.base_url}/generate rid={rid}: capture file {path} does not exist; is {self.shm_dir} "
                "the server's shared directory?"
            ) from exc
        except InferenceProtocolError as exc:
            raise InferenceProtocolError(f"{self.base_url}/generate rid={rid}: {exc}") from exc
        finally:
            # The file is ours once the server answered; a bad one is of no use to anybody either.
            path.unlink(missing_ok=True)
        return CapturedStates(aux_hidden_state, hidden_state, meta_info)

    # ------------------------------------------------------------------------------------------------------
    # Decoding

    def generate(
        self,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        text: str | list[str] | None = None,
        sampling_params: dict[str, Any],
        rid: str | list[str] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Decode from token ids or text; the server's JSON answer (a list for a batch of prompts)."""
        if (input_ids is None) == (text is None):
            raise ValueError("give exactly one of input_ids and text")
        body: dict[str, Any] = {"sampling_params": sampling_params}
        body.update({"input_ids": input_ids} if input_ids is not None else {"text": text})
        if rid is not None:
            body["rid"] = rid
        rid_label = rid if isinstance(rid, str) or rid is None else ",".join(rid)
        return self._json(self._request("POST", "/generate", rid=rid_label, json=body), rid_label)

    # ------------------------------------------------------------------------------------------------------
    # HTTP and error mapping

    def _request(self, method: str, path: str, *, rid: str | None, **kwargs: Any) -> httpx.Response:
        def call(http: httpx.Client) -> httpx.Response:
            try:
                response = http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                raise self._unavailable(path, rid, exc) from exc
            self._raise_for_status(response, path, rid)
            return response

        return self._watched(call, path, rid)

    def _watched(self, call: Callable[[httpx.Client], T], path: str, rid: str | None) -> T:
        """Run one request on a thread of its own and wait for it as long as the server's /health answers; once
        /health has been silent for health_timeout_s, abandon it (its thread ends at its own timeout)."""
        http = self._http
        result: Future[T] = Future()

        def run() -> None:
            try:
                result.set_result(call(http))
            except BaseException as exc:
                result.set_exception(exc)

        with self._health.outstanding():
            threading.Thread(target=run, name="inference-request", daemon=True).start()
            while True:
                try:
                    answer = result.result(timeout=self._health.probe_interval_s)
                except InferenceUnavailable:
                    self._answered = False
                    raise
                except TimeoutError:
                    silent_s = self._health.silent_s()
                    if silent_s >= self.health_timeout_s:
                        self._answered = False
                        self._drop(http)
                        where = f"{self.base_url}{path}" + (f" rid={rid}" if rid is not None else "")
                        raise InferenceUnavailable(
                            f"{where}: abandoned, the server hangs: its /health has not answered for {silent_s:.0f}s "
                            f"(EAGLE3_INFERENCE_HEALTH_TIMEOUT_S={self.health_timeout_s:.0f})"
                        ) from None
                else:
                    self._answered = True
                    return answer

    def _drop(self, http: httpx.Client) -> None:
        """Abandoned requests keep their pooled connections until their own timeout: later requests get a new
        pool instead of waiting for those."""
        with self._http_lock:
            if self._http is http:
                self._http = self._new_http()
                threading.Thread(target=http.close, name="inference-close", daemon=True).start()

    @contextmanager
    def _stream(
        self, http: httpx.Client, method: str, path: str, *, rid: str, **kwargs: Any
    ) -> Iterator[httpx.Response]:
        """A streamed request whose status and transport errors (also while reading the body) are mapped."""
        try:
            with http.stream(method, path, **kwargs) as response:
                if not response.is_success:
                    response.read()
                    self._raise_for_status(response, path, rid)
                yield response
        except httpx.TransportError as exc:
            raise self._unavailable(path, rid, exc) from exc

    @staticmethod
    def _read_body(response: httpx.Response) -> bytearray:
        """The whole body in one writable buffer, so that decoded tensors can view it without another copy."""
        content = bytearray(int(response.headers.get("content-length", 0)))
        received = 0
        for chunk in response.iter_bytes():
            # Slice assignment fills the preallocated buffer, and grows it past a missing or short content-length.
            content[received : received + len(chunk)] = chunk
            received += len(chunk)
        del content[received:]
        return content

    def _raise_for_status(self, response: httpx.Response, path: str, rid: str | None) -> None:
        if response.is_success:
            return
        where = f"{self.base_url}{path}" + (f" rid={rid}" if rid is not None else "")
        message = f"{where}: {response.status_code} {_error_message(response)}"
        if response.status_code >= 500:
            raise InferenceUnavailable(message)
        raise InferenceProtocolError(message)

    def _unavailable(self, path: str, rid: str | None, exc: httpx.TransportError) -> InferenceUnavailable:
        where = f"{self.base_url}{path}" + (f" rid={rid}" if rid is not None else "")
        return InferenceUnavailable(f"{where}: {type(exc).__name__}: {exc}")

    def _json(self, response: httpx.Response, rid: str | None) -> Any:
        try:
            return response.json()
        except ValueError as exc:
            raise InferenceProtocolError(
                f"{self.base_url}{response.request.url.path} rid={rid}: answer is not JSON "
                f"({response.headers.get('content-type')}): {exc}"
            ) from exc


def _error_message(response: httpx.Response) -> str:
    """The server's message from `{"error": {"message": ...}}`, else the start of the body."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500]

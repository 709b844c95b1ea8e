"""The producer API: jobs, progress, metrics, the dashboard, and API docs that work without internet."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, status
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import shared
from services.producer import errors
from services.producer.deps import get_redis
from services.producer.maintenance import Maintenance
from services.producer.metrics import ClusterCollector, JobsCollector
from services.producer.routes import jobs, ops
from shared import access
from shared.lifecycle.kinds import KINDS
from shared.settings import Settings, get_settings

STATIC = Path(__file__).parent / "static"


UPLOAD_PATH = "/v1/jobs/upload"


class BodySizeLimit:
    """413 for a request body over its limit: uploads get EAGLE3_API_MAX_UPLOAD_BYTES, every other request
    EAGLE3_API_MAX_REQUEST_BYTES. Refused from Content-Length before reading, else counted as it arrives."""

    def __init__(self, app: ASGIApp, *, max_request_bytes: int, max_upload_bytes: int) -> None:
        self.app = app
        self.limits = {UPLOAD_PATH: (max_upload_bytes, "EAGLE3_API_MAX_UPLOAD_BYTES")}
        self.default = (max_request_bytes, "EAGLE3_API_MAX_REQUEST_BYTES")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, setting = self.limits.get(scope["path"], self.default)
        too_large = f"request body over {limit} bytes ({setting})"
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return await JSONResponse({"detail": too_large}, status_code=413)(scope, receive, send)
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:  # a chunked body, or one longer than it said
                raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, too_large)
            return message

        await self.app(scope, receive_within_limit, send)


def document_kind_options(app: FastAPI) -> None:
    """/openapi.json and /docs: the job spec takes each kind's own options flat beside its common fields, and a job's
    record holds each kind's own fields beside its common ones (both checked against the kind's declaration,
    shared/lifecycle/kind.py), so the schemas list them, each saying its kinds."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()  # FastAPI's own, which it keeps as app.openapi_schema: completed here once
        _add_kind_fields(schema, "JobSpec", {name: kind.options for name, kind in KINDS.items()})
        _add_kind_fields(schema, "JobRecord", {name: kind.record for name, kind in KINDS.items()})
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend its schema


def _add_kind_fields(schema: dict[str, Any], model: str, declared: dict[str, type[BaseModel]]) -> None:
    components = schema["components"]["schemas"]
    if model not in components:
        return
    properties = components[model].setdefault("properties", {})
    meanings: dict[str, list[str]] = {}
    for kind, fields in declared.items():
        own = fields.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, definition in own.pop("$defs", {}).items():
            components.setdefault(name, definition)
        for name, field in own.get("properties", {}).items():
            properties.setdefault(name, field)
            meanings.setdefault(name, []).append(f"{kind} jobs: {field.get('description', '')}".strip())
    for name, meaning in meanings.items():
        properties[name]["description"] = "; ".join(meaning)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    access.check_api_settings(settings)  # closed by default: no token, no start

    # /docs serves Swagger UI from the fastapi-offline wheel, not a CDN: clusters are often air-gapped. No ReDoc:
    # its bundle still fetches a logo from its CDN.
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        maintenance = Maintenance(settings)  # retention and event trimming while the API serves
        maintenance.start()
        try:
            yield
        finally:
            maintenance.stop()

    app = FastAPIOffline(
        title="EAGLE-3 hidden-state factory",
        version=shared.__version__,
        static_url="/docs/static",
        redoc_url=None,
        lifespan=lifespan,
    )
    app.add_middleware(
        BodySizeLimit,
        max_request_bytes=settings.api_max_request_bytes,
        max_upload_bytes=settings.api_max_upload_bytes,
    )
    app.include_router(jobs.router)
    app.include_router(jobs.budget_router)
    app.include_router(ops.router)
    document_kind_options(app)

    errors.install(app, settings)

    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
    if settings is not get_settings():
        app.dependency_overrides[get_settings] = lambda: settings
    registry = CollectorRegistry()
    registry.register(JobsCollector(get_redis(settings), settings))
    registry.register(ClusterCollector(get_redis(settings), settings))

    @app.get("/health", tags=["ops"])
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse)
    def metrics() -> bytes:
        return generate_latest(registry)

    @app.get("/dashboard", tags=["ops"], response_class=FileResponse)
    def dashboard() -> FileResponse:
        """Jobs (state, progress, rate, ETA, failures, storage, stalled flag), workers and the queue, live."""
        return FileResponse(STATIC / "dashboard.html")

    @app.get("/dashboard/jobs/{job_id}", tags=["ops"], response_class=FileResponse)
    def dashboard_job(job_id: str) -> FileResponse:
        """One job: settings, charts over time, dead letters, rejected lines, trainer curves (the page reads the id)."""
        return FileResponse(STATIC / "job.html")

    return app


def serve(settings: Settings) -> None:
    import uvicorn

    uvicorn.run(create_app(settings), host=settings.api_host, port=settings.api_port, log_level="info")

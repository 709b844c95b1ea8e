"""The producer API: jobs, progress, metrics, the dashboard, and API docs that work without internet."""

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from prometheus_client import CollectorRegistry, generate_latest

import shared
from services.producer.deps import get_redis
from services.producer.metrics import ClusterCollector, JobsCollector
from services.producer.routes import jobs, ops
from shared.settings import Settings, get_settings

STATIC = Path(__file__).parent / "static"


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    # /docs serves Swagger UI from the fastapi-offline wheel, not a CDN: clusters are often air-gapped. No ReDoc:
    # its bundle still fetches a logo from its CDN.
    app = FastAPIOffline(
        title="EAGLE-3 hidden-state factory", version=shared.__version__, static_url="/docs/static", redoc_url=None
    )
    app.include_router(jobs.router)
    app.include_router(ops.router)
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

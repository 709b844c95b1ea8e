"""The producer API: jobs, progress, metrics, and a small dashboard."""

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, generate_latest

import shared
from services.producer.deps import get_redis
from services.producer.metrics import JobsCollector
from services.producer.routes import jobs
from shared.settings import Settings, get_settings

DASHBOARD = Path(__file__).parent / "static" / "dashboard.html"


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(title="EAGLE-3 hidden-state factory", version=shared.__version__)
    app.include_router(jobs.router)
    if settings is not get_settings():
        app.dependency_overrides[get_settings] = lambda: settings
    registry = CollectorRegistry()
    registry.register(JobsCollector(get_redis(settings), settings))

    @app.get("/health", tags=["ops"])
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse)
    def metrics() -> bytes:
        return generate_latest(registry)

    @app.get("/dashboard", tags=["ops"], response_class=HTMLResponse)
    def dashboard() -> str:
        return DASHBOARD.read_text()

    return app


def serve(settings: Settings) -> None:
    import uvicorn

    uvicorn.run(create_app(settings), host=settings.api_host, port=settings.api_port, log_level="info")

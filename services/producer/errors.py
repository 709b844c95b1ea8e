"""Domain errors as HTTP answers, in one place: a route raises what went wrong (shared/errors.py) and this maps it,
so that one cause gets one status and one message on every route (a job that does not exist is the same 404
whether it is read, cancelled, resumed or charted).

| raised | status |
|---|---|
| JobNotFound | 404 |
| OverBudget (a job projected over the storage budget) | 413 |
| DependencyUnavailable (Redis or storage down at submit), a Redis outage, StorageUnavailable | 503, Retry-After |
| SubmitError (any other bad submit) | 422 |
| JobExists (a taken job id), DeleteRefused (a job runs or is followed), JobDeleting (a resume of one deleting) | 409 |

Starlette picks the handler of the most specific class, so OverBudget, JobExists and DependencyUnavailable are not
422s.
"""

import redis
from fastapi import FastAPI, Request, status
from fastapi.responses import JSONResponse

from shared import urls
from shared.errors import (
    DeleteRefused,
    DependencyUnavailable,
    JobDeleting,
    JobExists,
    JobNotFound,
    OverBudget,
    StorageUnavailable,
    SubmitError,
)
from shared.settings import Settings

RETRY_AFTER_S = 5  # what a 503 tells the client to wait before it tries again


def install(app: FastAPI, settings: Settings) -> None:
    def answer(status_code: int, detail: str) -> JSONResponse:
        return JSONResponse({"detail": urls.redact_url(detail)}, status_code=status_code)

    def unavailable(detail: str) -> JSONResponse:
        response = answer(status.HTTP_503_SERVICE_UNAVAILABLE, detail)
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    @app.exception_handler(JobNotFound)
    async def job_not_found(request: Request, exc: JobNotFound) -> JSONResponse:
        return answer(status.HTTP_404_NOT_FOUND, str(exc))

    @app.exception_handler(OverBudget)
    async def over_budget(request: Request, exc: OverBudget) -> JSONResponse:
        return answer(status.HTTP_413_CONTENT_TOO_LARGE, str(exc))

    @app.exception_handler(DeleteRefused)
    @app.exception_handler(JobDeleting)
    @app.exception_handler(JobExists)
    async def conflict(request: Request, exc: Exception) -> JSONResponse:
        return answer(status.HTTP_409_CONFLICT, str(exc))

    @app.exception_handler(SubmitError)
    async def bad_submit(request: Request, exc: SubmitError) -> JSONResponse:
        return answer(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc))

    # An outage of what the API reads from is a 503 the client can retry, never a 500 that looks like a bug.
    @app.exception_handler(DependencyUnavailable)
    async def dependency_unavailable(request: Request, exc: DependencyUnavailable) -> JSONResponse:
        return unavailable(str(exc))

    @app.exception_handler(redis.ConnectionError)
    @app.exception_handler(redis.TimeoutError)
    async def redis_unavailable(request: Request, exc: redis.RedisError) -> JSONResponse:
        where = urls.redact_url(settings.redis_url)
        return unavailable(f"Redis at {where} is not reachable ({type(exc).__name__}: {exc}); retry shortly")

    @app.exception_handler(StorageUnavailable)
    async def storage_unavailable(request: Request, exc: StorageUnavailable) -> JSONResponse:
        return unavailable(f"storage is not usable ({exc}); retry shortly")

"""The producer API as the command line uses it: every job command reads and changes jobs through it, so each works
against a remote producer with only its URL and token (EAGLE3_API_URL, EAGLE3_API_TOKEN)."""

from typing import Any

import httpx

from shared import access
from shared.lifecycle.schemas import Progress
from shared.settings import Settings


class ApiError(SystemExit):
    """The API refused a request; the message is its status and detail."""


def api_client(settings: Settings, base_url: str | None = None) -> httpx.Client:
    # EAGLE3_API_TOKEN, else the session token of `eagle3 up`, which goes only to its own URL (shared/access.py).
    settings = settings if base_url is None else settings.model_copy(update={"api_url": base_url})
    return httpx.Client(base_url=settings.api_url, headers=access.auth_headers(settings), timeout=600)


def check(response: httpx.Response) -> Any:
    if response.is_error:
        detail = (
            response.json().get("detail", response.text)
            if "json" in response.headers.get("content-type", "")
            else response.text
        )
        raise ApiError(f"error {response.status_code}: {detail}")
    return response.json()


def read_progress(api: httpx.Client, job_id: str) -> Progress:
    return Progress.model_validate(check(api.get(f"/v1/jobs/{job_id}/progress")))


def list_progress(api: httpx.Client, *, older_than: str | None = None) -> list[Progress]:
    """Every job; with `older_than` (7d, 12h), only finished jobs that finished longer ago."""
    params = {} if older_than is None else {"older_than": older_than}
    return [Progress.model_validate(p) for p in check(api.get("/v1/jobs", params=params))]

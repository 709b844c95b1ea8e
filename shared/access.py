"""What a caller of the producer API may reach, and which secrets it must never see.

- Datasets (and a regenerate job's `output_url`, which workers write): objects in the storage bucket, files under
  the `file://` storage root (uploads and regenerated datasets live there), and files or `s3://` prefixes under
  `EAGLE3_DATASET_ROOTS`. Nothing else, since the producer can read far more of its host than a job should.
  Without dataset roots, local datasets are refused; `eagle3 up` and `eagle3 demo` configure their own folder.
- Target models: local folders under `EAGLE3_MODEL_ROOTS` (default: `EAGLE3_MODEL_PATH`'s parent and
  `{home}/models`).
- Local paths are checked after resolving symlinks and `..`, and the resolved path is what the producer reads.
- Job ids: one strict pattern for the ids clients choose and for path parameters, before either becomes a
  storage key.
- The API token: compared in constant time. `eagle3 up` keeps its session token in `{home}/api-token` (mode 0600)
  for the CLI, next to the URL it belongs to, so it is never sent to another API.
- URLs with userinfo (`redis://:password@host`) are redacted wherever they are shown; a job URL with credentials
  in it is refused, so job records never hold any.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import secrets
from pathlib import Path
from urllib.parse import unquote, urlparse

from shared.errors import ConfigurationError, SubmitError
from shared.settings import Settings
from shared.urls import is_loopback, redact_url

logger = logging.getLogger(__name__)

JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_JOB_ID = re.compile(JOB_ID_PATTERN)


class AccessDenied(SubmitError):
    """A job asks for a dataset, model or output outside what this producer is configured to serve."""


# ----------------------------------------------------------------------------------------------------------
# Small rules


def is_valid_job_id(job_id: str) -> bool:
    return _JOB_ID.fullmatch(job_id) is not None  # fullmatch: "$" alone lets a trailing newline through


# ----------------------------------------------------------------------------------------------------------
# Datasets, outputs, models


def confine_dataset_url(url: str, settings: Settings) -> str:
    """The dataset as the producer reads it: the `s3://` URL, or the resolved local path. AccessDenied, naming the
    rule, when it is anywhere else."""
    return _confine(url, settings, field="dataset_url")


def confine_output_url(url: str | None, settings: Settings) -> None:
    """A regenerate job's copy of its output goes where a dataset may come from."""
    if url is not None:
        _confine(url, settings, field="output_url")


def confine_model_path(value: str, settings: Settings) -> Path:
    """The resolved target model folder, when it lies under a model root."""
    if "://" in value:
        raise AccessDenied(f"model_path {redact_url(value)}: must be a local folder")
    resolved = Path(value).expanduser().resolve()
    roots = model_roots(settings)
    if any(resolved.is_relative_to(root) for root in roots):
        return resolved
    shown = ", ".join(str(r) for r in roots) or "none"
    raise AccessDenied(
        f"model_path {value}: {resolved} is outside the model roots ({shown}); add its parent folder to "
        "EAGLE3_MODEL_ROOTS"
    )


def model_roots(settings: Settings) -> list[Path]:
    roots = settings.model_roots
    if roots is None:
        roots = [settings.model_path.parent] if settings.model_path is not None else []
        roots.append(settings.home / "models")
    return [Path(root).expanduser().resolve() for root in roots]


def dataset_roots(settings: Settings) -> tuple[list[Path], list[tuple[str, str]]]:
    """(local folders, (bucket, key prefix) pairs) that datasets may come from: the storage root and the configured
    dataset roots."""
    local: list[Path] = []
    buckets: list[tuple[str, str]] = []
    for root in [settings.storage_url, *settings.dataset_roots]:
        parsed = urlparse(root)
        if parsed.scheme == "s3":
            prefix = parsed.path.strip("/")
            # The storage bucket as a whole (datasets put next to the jobs); a dataset root from its prefix on.
            buckets.append((parsed.netloc, "" if root == settings.storage_url or not prefix else prefix + "/"))
        else:
            path = Path(unquote(parsed.path)) if parsed.scheme == "file" else Path(root)
            local.append(path.expanduser().resolve())
    return local, buckets


def _confine(url: str, settings: Settings, *, field: str) -> str:
    shown = redact_url(url)
    local, buckets = dataset_roots(settings)
    if "://" in url:
        parsed = urlparse(url)
        if "@" in parsed.netloc:
            raise AccessDenied(f"{field} {shown}: credentials in a URL are refused (S3 credentials come from AWS_*)")
        if parsed.scheme == "s3":
            key = parsed.path.lstrip("/")
            if any(parsed.netloc == bucket and key.startswith(prefix) for bucket, prefix in buckets) and key:
                return url
            allowed = ", ".join(f"s3://{b}/{p}" for b, p in buckets) or "none"
            raise AccessDenied(
                f"{field} {shown}: s3:// objects must be in the storage bucket or under an s3:// dataset root "
                f"({allowed}; EAGLE3_DATASET_ROOTS)"
            )
        if parsed.scheme != "file":
            raise AccessDenied(f"{field} {shown}: unsupported scheme {parsed.scheme!r} (use s3://, file:// or a path)")
        if parsed.netloc not in ("", "localhost"):
            raise AccessDenied(f"{field} {shown}: a file:// URL names a local path (file:///abs/path)")
        path = Path(unquote(parsed.path))
    else:
        path = Path(url)
    resolved = path.expanduser().resolve()
    if any(resolved.is_relative_to(root) for root in local):
        return str(resolved)
    shown_roots = ", ".join(str(r) for r in local)
    raise AccessDenied(
        f"{field} {shown}: {resolved} is outside the dataset roots ({shown_roots}); upload the file "
        "(POST /v1/jobs/upload, `eagle3 submit --upload`) or add its folder to EAGLE3_DATASET_ROOTS"
    )


# ----------------------------------------------------------------------------------------------------------
# The API token


def check_api_settings(settings: Settings) -> None:
    """At the producer's start: closed unless a token is set, or auth is explicitly off on a loopback address."""
    if settings.api_auth == "off":
        if not is_loopback(settings.api_host):
            raise ConfigurationError(
                f"EAGLE3_API_AUTH=off is accepted only when the API listens on a loopback address, but "
                f"EAGLE3_API_HOST={settings.api_host}: set EAGLE3_API_TOKEN instead, or bind to 127.0.0.1"
            )
        logger.warning("EAGLE3_API_AUTH=off: the API on %s accepts every request from this machine", settings.api_host)
        return
    if settings.api_token is None:
        raise ConfigurationError(
            "EAGLE3_API_TOKEN is not set, and the API does not start open: set it to a secret (openssl rand -hex 32; "
            "clients send `Authorization: Bearer <token>`), or EAGLE3_API_AUTH=off for an API on 127.0.0.1 only"
        )


def token_matches(presented: str | None, settings: Settings) -> bool:
    if presented is None or settings.api_token is None:
        return False
    return hmac.compare_digest(presented.encode(), settings.api_token.get_secret_value().encode())


def new_api_token() -> str:
    return secrets.token_urlsafe(32)


def session_token_file(settings: Settings) -> Path:
    return settings.home / "api-token"


def write_session_token(settings: Settings, api_url: str, token: str) -> Path:
    """The token of a local stack's API, readable by this user only, for the CLI in another terminal."""
    path = session_token_file(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a new file gets the mode below, whoever made the old one
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"api_url": api_url, "token": token}, f)
    return path


def client_token(settings: Settings) -> str | None:
    """The token a client sends to settings.api_url: EAGLE3_API_TOKEN, else the session token of `eagle3 up` when
    it belongs to that URL."""
    if settings.api_token is not None:
        return settings.api_token.get_secret_value()
    try:
        session = json.loads(session_token_file(settings).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(session, dict) or session.get("api_url") != settings.api_url:
        return None
    token = session.get("token")
    return token if isinstance(token, str) and token else None


def auth_headers(settings: Settings) -> dict[str, str]:
    token = client_token(settings)
    return {"Authorization": f"Bearer {token}"} if token else {}

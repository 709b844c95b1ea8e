"""FastAPI dependencies: settings, storage, Redis, the shard sender, and the API token check."""

from functools import cache
from typing import Annotated

import redis
from fastapi import Depends, HTTPException, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from shared import access
from shared.lifecycle.jobs import Enqueue
from shared.lifecycle.queue import ShardSender
from shared.settings import Settings, get_settings
from shared.storage.objects import Storage, open_storage

SettingsDep = Annotated[Settings, Depends(get_settings)]
# What a client is told to wait before asking again while Redis or storage is down (a restart takes seconds).


_storages: dict[tuple[str, str | None], Storage] = {}


@cache
def _redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)


@cache
def _sender(broker_url: str) -> ShardSender:
    return ShardSender(broker_url)


def get_storage(settings: SettingsDep) -> Storage:
    # One per store (its S3 client pools connections), opened with the app's settings (endpoint, region).
    key = (settings.storage_url, settings.s3_endpoint_url)
    if key not in _storages:
        _storages[key] = open_storage(settings.storage_url, settings)
    return _storages[key]


def get_redis(settings: SettingsDep) -> redis.Redis:
    return _redis(settings.redis_url)


def get_enqueue(settings: SettingsDep) -> Enqueue:
    return _sender(settings.redis_url).send


_bearer = HTTPBearer(auto_error=False, description="EAGLE3_API_TOKEN")


def require_token(
    settings: SettingsDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    if settings.api_auth == "off":  # accepted only on a loopback address (shared/access.py)
        return
    if not access.token_matches(credentials.credentials if credentials else None, settings):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing or wrong bearer token (the API's EAGLE3_API_TOKEN)",
            headers={"WWW-Authenticate": "Bearer"},
        )


def valid_job_id(job_id: str) -> str:
    """A job id from the path, checked before it becomes a storage key: anything else names no job."""
    if not access.is_valid_job_id(job_id):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id!r} not found (not a valid job id)")
    return job_id


StorageDep = Annotated[Storage, Depends(get_storage)]
RedisDep = Annotated[redis.Redis, Depends(get_redis)]
EnqueueDep = Annotated[Enqueue, Depends(get_enqueue)]
Authorized = Depends(require_token)
JobIdPath = Annotated[str, Depends(valid_job_id)]

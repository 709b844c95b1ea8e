"""FastAPI dependencies: settings, storage, Redis, the shard sender, and the API token check."""

from functools import cache
from typing import Annotated

import redis
from fastapi import Depends, Header, HTTPException, status

from shared.jobs import Enqueue
from shared.queue import ShardSender
from shared.settings import Settings, get_settings
from shared.storage import Storage, open_storage

SettingsDep = Annotated[Settings, Depends(get_settings)]


@cache
def _storage(url: str) -> Storage:
    return open_storage(url, get_settings())


@cache
def _redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)


@cache
def _sender(broker_url: str) -> ShardSender:
    return ShardSender(broker_url)


def get_storage(settings: SettingsDep) -> Storage:
    return _storage(settings.storage_url)


def get_redis(settings: SettingsDep) -> redis.Redis:
    return _redis(settings.redis_url)


def get_enqueue(settings: SettingsDep) -> Enqueue:
    return _sender(settings.redis_url).send


def require_token(settings: SettingsDep, authorization: Annotated[str | None, Header()] = None) -> None:
    if settings.api_token is None:
        return
    if authorization != f"Bearer {settings.api_token}":
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing or wrong bearer token (EAGLE3_API_TOKEN)",
            headers={"WWW-Authenticate": "Bearer"},
        )


StorageDep = Annotated[Storage, Depends(get_storage)]
RedisDep = Annotated[redis.Redis, Depends(get_redis)]
EnqueueDep = Annotated[Enqueue, Depends(get_enqueue)]
Authorized = Depends(require_token)

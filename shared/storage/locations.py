"""A file named by a local path, a `file://` URL or an `s3://bucket/key` URL, as jobs name their datasets and
outputs: its lines read, its bytes written whole (replaced atomically), whether it exists. The one place that tells
the three apart; a caller first confines the URL to what it may reach (shared/access.py)."""

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from shared.errors import ConfigurationError
from shared.settings import Settings
from shared.storage.objects import ObjectNotFound, Storage, open_storage


def _s3_object(url: str, settings: Settings | None) -> tuple[Storage, str] | None:
    """The bucket's storage and the key, for an s3:// URL; None for a local file."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        return open_storage(f"s3://{parsed.netloc}", settings), parsed.path.lstrip("/")
    if parsed.scheme not in ("", "file"):
        raise ConfigurationError(f"{url}: unsupported scheme {parsed.scheme!r} (use a path, file:// or s3://)")
    return None


def _path(url: str) -> Path:
    parsed = urlparse(url)
    return Path(parsed.path) if parsed.scheme == "file" else Path(url)


def read_lines(url: str, settings: Settings | None) -> Iterator[bytes]:
    """The file's lines (a local file streamed, an object read whole); ObjectNotFound when it is not there."""
    s3 = _s3_object(url, settings)
    if s3 is not None:
        storage, key = s3
        yield from storage.get(key).splitlines()
        return
    path = _path(url)
    if not path.is_file():
        raise ObjectNotFound(url)
    with path.open("rb") as f:
        yield from f


def write_whole(url: str, data: bytes, settings: Settings | None) -> None:
    """The file replaced by `data` at once: a reader sees the old bytes or the new ones, never a part."""
    s3 = _s3_object(url, settings)
    if s3 is not None:
        storage, key = s3
        storage.put(key, data)
        return
    path = _path(url)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def exists(url: str, settings: Settings | None) -> bool:
    s3 = _s3_object(url, settings)
    if s3 is not None:
        storage, key = s3
        return storage.exists(key)
    return _path(url).exists()

"""Object storage: one small interface, a local-directory backend and an S3 backend.

Notable:
- Keys are '/'-separated paths relative to the root the storage was opened with
  (`job-1/manifests/shard_000000.json`); `..`, `.`, empty segments and a leading '/' are refused.
- `put_if_absent` is create-only and never torn, so a shard manifest is committed whole: `os.link` of a fully
  written temp file on a directory (atomic), `If-None-Match: *` on S3 (PutObject, or CompleteMultipartUpload above
  the multipart threshold; atomic on AWS S3 and MinIO). SeaweedFS checks the precondition before writing, so two
  simultaneous creates can both land; a writer whose object was replaced learns it from the ETag and reports False,
  and the stored bytes always belong to a writer told True.
- `put_if_absent_from` is the same create-only write for an object that a function writes as a stream (a sample
  file straight from `torch.save`): the bytes go to the file as they come, hashed on the way, so a 64 MB object
  is neither buffered in memory first nor read back to be hashed (S3 buffers it: a PUT needs the whole body).
- Outages (unreachable, throttled, timed out, full, missing bucket, bad credentials) raise
  `StorageUnavailable`, which tasks retry with backoff (`StorageFull`, a subclass, pauses the job until there is
  room: shared/lifecycle/shards.py); a missing object raises `ObjectNotFound`;
  a request the store refuses for good (an object too large) raises `StorageRejected`.
- One boto3 client per process, created lazily and dropped in a forked child, because Celery's
  prefork pool forks after import and a client's connection pool must not cross a fork.
"""

import contextlib
import errno
import hashlib
import io
import logging
import math
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.client import BaseClient
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)

from shared.errors import ConfigurationError, Eagle3Error, StorageFull, StorageUnavailable
from shared.settings import Settings, get_settings

logger = logging.getLogger(__name__)

# Names starting with this are ours (temp files, write probes): list() hides them and keys may not use them.
RESERVED_PREFIX = ".eagle3-"


class ObjectNotFound(Eagle3Error, KeyError):
    def __init__(self, key: str, root: str = "") -> None:
        super().__init__(f"object {key!r} not found" + (f" in {root}" if root else ""))
        self.key = key

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message and wrap it in quotes.
        return str(self.args[0])


class InvalidKey(Eagle3Error, ValueError):
    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"invalid storage key {key!r}: {reason}")
        self.key, self.reason = key, reason


class StorageRejected(Eagle3Error):
    """The store refused a request for a reason that a retry cannot fix (e.g. EntityTooLarge)."""


@dataclass(frozen=True)
class ObjectDigest:
    """The size and sha256 of an object's bytes, as a manifest records them."""

    size_bytes: int
    sha256: str

    @classmethod
    def of(cls, data: bytes) -> "ObjectDigest":
        return cls(len(data), hashlib.sha256(data).hexdigest())


class HashingWriter:
    """A write-only binary stream that hands each chunk to `sink` and keeps the sha256 and size of all of them."""

    def __init__(self, sink: Callable[[memoryview], object]) -> None:
        self._sink = sink
        self._sha256 = hashlib.sha256()
        self._size_bytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        # The chunk may be a view of the caller's memory that is valid only during this call (torch.save's is).
        view = memoryview(data).cast("B")
        self._sha256.update(view)
        self._sink(view)
        self._size_bytes += len(view)
        return len(view)

    def flush(self) -> None:
        """Nothing is held here; torch.save calls it once at the end."""

    def digest(self) -> ObjectDigest:
        return ObjectDigest(self._size_bytes, self._sha256.hexdigest())


class Storage(Protocol):
    url: str  # the root URL it was opened with

    def put(self, key: str, data: bytes) -> None: ...
    def put_if_absent(self, key: str, data: bytes) -> bool: ...
    def put_if_absent_from(self, key: str, write: Callable[[HashingWriter], None]) -> ObjectDigest | None: ...
    def get(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def size(self, key: str) -> int: ...
    def list(self, prefix: str) -> list[str]: ...
    def total_size(self) -> int: ...
    def delete(self, key: str) -> None: ...
    def delete_many(self, keys: Sequence[str]) -> None: ...
    def check(self) -> None: ...


def open_storage(url: str, settings: Settings | None = None) -> Storage:
    """`file:///abs/dir` or a plain path -> FileStorage; `s3://bucket/optional/prefix` -> S3Storage."""
    scheme = urlparse(url).scheme if "://" in url else ""
    if scheme in ("", "file"):
        return FileStorage(url, fsync=(settings or get_settings()).file_fsync)
    if scheme == "s3":
        return S3Storage(url, settings or get_settings())
    raise ConfigurationError(f"storage url {url!r}: unsupported scheme {scheme!r} (use file:///abs/dir or s3://bucket)")


def validate_key(key: str) -> str:
    if not key:
        raise InvalidKey(key, "empty")
    if key.startswith("/"):
        raise InvalidKey(key, "must be relative (no leading '/')")
    _check_segments(key, key.split("/"))
    return key


def validate_prefix(prefix: str) -> str:
    """A list prefix: '' (everything) or a key-like path; a trailing '/' limits it to one folder."""
    if prefix.startswith("/"):
        raise InvalidKey(prefix, "must be relative (no leading '/')")
    segments = prefix.split("/")
    # The last segment may be empty (trailing '/') or a partial name ('manifests/shard_').
    _check_segments(prefix, segments[:-1])
    if segments[-1] in (".", ".."):
        raise InvalidKey(prefix, f"segment {segments[-1]!r} not allowed")
    return prefix


def _check_segments(key: str, segments: list[str]) -> None:
    for segment in segments:
        if segment in ("", ".", ".."):
            raise InvalidKey(key, f"segment {segment!r} not allowed")
        if segment.startswith(RESERVED_PREFIX):
            raise InvalidKey(key, f"names starting with {RESERVED_PREFIX!r} are reserved")
        if "\x00" in segment:
            raise InvalidKey(key, "NUL character")


def _is_reserved(key: str) -> bool:
    return key.rsplit("/", 1)[-1].startswith(RESERVED_PREFIX)


# ---------------------------------------------------------------------------------------------------------------------
# Local directory


# OSError numbers that mean the disk, not our code, is the problem: retrying later (or elsewhere) can succeed.
_UNAVAILABLE_ERRNOS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.EIO: "I/O error",
}
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


class FileStorage:
    """Objects are files under a root directory; parents are created as needed.

    Every write is atomic (temp file, then rename or link), so a killed process never leaves a torn object.
    With `fsync` the bytes and the directory entry are also flushed to disk before the call returns, which
    survives a power loss at the cost of disk-bound writes; without it, the manifests' sha256 still tells a
    file torn by a power loss from a good one.
    """

    def __init__(self, url: str, *, fsync: bool = True) -> None:
        self.fsync = fsync
        if "://" in url:
            parsed = urlparse(url)
            if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
                raise ConfigurationError(f"storage url {url!r}: expected file:///absolute/dir")
            root = Path(unquote(parsed.path))
            if not root.is_absolute():
                raise ConfigurationError(f"storage url {url!r}: the path must be absolute")
            self.url = url
        else:
            root = Path(url).resolve()
            self.url = root.as_uri()
        self.root = root

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        with self._os_errors(key, "put"):
            tmp = self._write_temp(path, lambda fd: _write_all(fd, memoryview(data)))
            try:
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            if self.fsync:
                _fsync_dir(path.parent)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        with self._os_errors(key, "put_if_absent"):
            tmp = self._write_temp(path, lambda fd: _write_all(fd, memoryview(data)))
            return self._link_new(tmp, path)

    def put_if_absent_from(self, key: str, write: Callable[[HashingWriter], None]) -> ObjectDigest | None:
        """Create `key` from what `write` writes into the stream it is given; its digest, or None if `key` exists
        (the stream was written and thrown away then). The bytes go straight to the temp file, hashed on the way."""
        path = self._path(key)
        with self._os_errors(key, "put_if_absent"):
            digest: ObjectDigest | None = None

            def fill(fd: int) -> None:
                nonlocal digest
                writer = HashingWriter(lambda view: _write_all(fd, view))
                write(writer)
                digest = writer.digest()

            tmp = self._write_temp(path, fill)
            return digest if self._link_new(tmp, path) else None

    def _link_new(self, tmp: Path, path: Path) -> bool:
        """Publish a complete temp file under `path` unless that exists; the temp file is removed either way."""
        try:
            # link() fails if the name exists, so readers see either nothing or the whole fsynced file.
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        if self.fsync:
            _fsync_dir(path.parent)
        return True

    def get(self, key: str) -> bytes:
        path = self._path(key)
        with self._os_errors(key, "get"):
            try:
                return path.read_bytes()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise ObjectNotFound(key, self.url) from None

    def exists(self, key: str) -> bool:
        path = self._path(key)
        with self._os_errors(key, "exists"):
            return path.is_file()

    def size(self, key: str) -> int:
        path = self._path(key)
        with self._os_errors(key, "size"):
            try:
                st = path.stat()
            except (FileNotFoundError, NotADirectoryError):
                raise ObjectNotFound(key, self.url) from None
            if not stat.S_ISREG(st.st_mode):
                raise ObjectNotFound(key, self.url)
            return st.st_size

    def list(self, prefix: str) -> list[str]:
        validate_prefix(prefix)
        # Walk only the deepest folder the prefix names, then filter by the partial last segment.
        folder = prefix.rpartition("/")[0]
        base = self.root / folder if folder else self.root
        keys = []
        with self._os_errors(prefix, "list"):
            for dirpath, _, filenames in os.walk(base):
                rel_dir = Path(dirpath).relative_to(self.root).as_posix()
                for name in filenames:
                    key = name if rel_dir == "." else f"{rel_dir}/{name}"
                    if key.startswith(prefix) and not name.startswith(RESERVED_PREFIX):
                        keys.append(key)
        return sorted(keys)

    def total_size(self) -> int:
        """Bytes of every object in the store (what a storage budget counts), temporary files of writes left out."""
        total = 0
        with self._os_errors("", "total_size"):
            for dirpath, _, filenames in os.walk(self.root):
                for name in filenames:
                    if not name.startswith(RESERVED_PREFIX):
                        with contextlib.suppress(FileNotFoundError):  # deleted while the walk went on
                            total += (Path(dirpath) / name).stat().st_size
        return total

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._os_errors(key, "delete"):
            path.unlink(missing_ok=True)

    def delete_many(self, keys: Sequence[str]) -> None:
        """Remove the files, then the folders they leave empty (never the root)."""
        folders: set[Path] = set()
        for key in keys:
            self.delete(key)
            folders.update(p for p in self._path(key).parents if p != self.root and self.root in p.parents)
        for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):  # the deepest first
            with contextlib.suppress(OSError):  # not empty (or gone): it stays
                folder.rmdir()

    def check(self) -> None:
        probe = self.root / f"{RESERVED_PREFIX}check-{uuid.uuid4().hex}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, b"ok")
                os.fsync(fd)
            finally:
                os.close(fd)
            probe.unlink()
        except OSError as exc:
            reason = _UNAVAILABLE_ERRNOS.get(exc.errno or 0, exc.strerror or str(exc))
            raise StorageUnavailable(f"file storage {self.url} is not writable: {reason} ({exc})") from exc

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    def _write_temp(self, path: Path, fill: Callable[[int], None]) -> Path:
        """A temp file next to path, written by `fill` through its descriptor and fsynced, so that a rename or
        link publishes complete bytes."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{RESERVED_PREFIX}{path.name}.{uuid.uuid4().hex}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            fill(fd)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        return tmp

    @contextmanager
    def _os_errors(self, key: str, op: str) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            reason = _UNAVAILABLE_ERRNOS.get(exc.errno or 0)
            if reason is None:
                raise
            error = StorageFull if exc.errno in _FULL_ERRNOS else StorageUnavailable
            raise error(f"file storage {self.url}: {op} {key!r} failed: {reason} ({exc})") from exc


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        # os.write may write less than asked (and at most ~2 GiB per call on Linux).
        written = os.write(fd, view)
        view = view[written:]


def _fsync_dir(path: Path) -> None:
    # Makes the new directory entry durable; without it a crash can lose a file whose bytes were fsynced.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------------------
# S3


S3_MIN_PART_BYTES = 5 * 1024 * 1024  # S3 refuses smaller parts, except the last one
S3_MAX_PARTS = 10_000
S3_DELETE_BATCH = 1000  # the most keys one DeleteObjects request may name
S3_CONNECT_TIMEOUT_S = 5.0
S3_READ_TIMEOUT_S = 60.0  # per socket read, not per request: a 64 MiB part keeps the socket busy
# botocore's "standard" mode retries throttling, 5xx and connection errors with jittered backoff (about 3 s in
# all at 3 attempts); longer outages are the caller's to retry (Celery backoff), so a task never hangs here.
S3_MAX_ATTEMPTS = 3
CONFLICT_ATTEMPTS = 5  # 409 ConditionalRequestConflict: a concurrent create-only write to the same key was in flight

_THROTTLED_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "RequestTimeout",
    "InternalError",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
}
_FULL_CODES = {"QuotaExceeded", "InsufficientStorage", "XMinioStorageFull", "StorageFull"}
_CREDENTIAL_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}

# Credentials are read from the environment when a client is made, so the variables that carry them are part of the
# key: a changed environment (a test, a re-exec with rotated keys) gets a new client instead of stale credentials.
_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
_clients: dict[tuple[str | None, ...], BaseClient] = {}
_clients_lock = threading.Lock()


def _forget_clients_after_fork() -> None:
    global _clients_lock
    # The child must not reuse the parent's sockets; the lock may have been held by a parent thread at fork time.
    _clients.clear()
    _clients_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_clients_after_fork)


def _s3_client(endpoint_url: str | None, region: str, max_pool_connections: int) -> BaseClient:
    key = (endpoint_url, region, str(max_pool_connections), *(os.environ.get(name) for name in _CREDENTIAL_ENV))
    client = _clients.get(key)
    if client is not None:
        return client
    with _clients_lock:
        if key not in _clients:
            config = Config(
                connect_timeout=S3_CONNECT_TIMEOUT_S,
                read_timeout=S3_READ_TIMEOUT_S,
                retries={"mode": "standard", "max_attempts": S3_MAX_ATTEMPTS},
                # boto3 >= 1.36 sends CRC checksums by default, which many S3-compatible servers reject.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                max_pool_connections=max_pool_connections,
                # A custom endpoint (compose service name, IP) has no wildcard DNS for bucket.host names.
                s3={"addressing_style": "path"} if endpoint_url else {},
            )
            # A Session per client: the default session is not thread-safe; credentials come from the AWS_* env.
            _clients[key] = boto3.session.Session().client(
                "s3", endpoint_url=endpoint_url, region_name=region, config=config
            )
        return _clients[key]


class S3Storage:
    """Objects under `s3://bucket/prefix` on AWS or any S3-compatible server (SeaweedFS, MinIO)."""

    def __init__(self, url: str, settings: Settings) -> None:
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ConfigurationError(f"storage url {url!r}: expected s3://bucket/optional/prefix")
        self.url = url
        self.bucket = parsed.netloc
        prefix = parsed.path.strip("/")
        if prefix:
            validate_prefix(prefix)
        self.prefix = f"{prefix}/" if prefix else ""
        self.endpoint_url = settings.s3_endpoint_url
        self.region = settings.s3_region
        self.multipart_threshold_bytes = settings.s3_multipart_threshold_bytes
        self.multipart_chunk_bytes = settings.s3_multipart_chunk_bytes
        self.max_concurrency = settings.s3_max_concurrency

    @property
    def _client(self) -> BaseClient:
        # Resolved on every call (a dict lookup) so a storage object built before a fork gets the child's client.
        return _s3_client(self.endpoint_url, self.region, max(10, self.max_concurrency + 2))

    def put(self, key: str, data: bytes) -> None:
        name = self._name(key)
        with self._s3_errors(key, "put"):
            if len(data) < self.multipart_threshold_bytes:
                self._client.put_object(Bucket=self.bucket, Key=name, Body=data)
                return
            transfer = TransferConfig(
                multipart_threshold=self.multipart_threshold_bytes,
                multipart_chunksize=self._part_bytes(len(data)),
                max_concurrency=self.max_concurrency,
                preferred_transfer_client="classic",
            )
            self._client.upload_fileobj(io.BytesIO(data), self.bucket, name, Config=transfer)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        name = self._name(key)
        with self._s3_errors(key, "put_if_absent"):
            attempt = 0
            while True:
                attempt += 1
                try:
                    if len(data) < self.multipart_threshold_bytes:
                        etag = self._client.put_object(Bucket=self.bucket, Key=name, Body=data, IfNoneMatch="*")["ETag"]
                    else:
                        etag = self._put_multipart_if_absent(name, data)
                    return self._still_ours(name, etag)
                except ClientError as exc:
                    code, status = _error_code(exc)
                    if code == "PreconditionFailed" or status == 412:
                        return False
                    if code != "ConditionalRequestConflict" or attempt == CONFLICT_ATTEMPTS:
                        raise
                    logger.warning("s3 create-only write conflict key=%s attempt=%d, retrying", name, attempt)
                    time.sleep(0.1 * 2**attempt)

    def put_if_absent_from(self, key: str, write: Callable[[HashingWriter], None]) -> ObjectDigest | None:
        """As FileStorage.put_if_absent_from; the object is buffered here, since a PUT sends a whole body."""
        buffer = io.BytesIO()
        writer = HashingWriter(buffer.write)
        write(writer)
        return writer.digest() if self.put_if_absent(key, buffer.getvalue()) else None

    def get(self, key: str) -> bytes:
        name = self._name(key)
        with self._s3_errors(key, "get"):
            body = self._client.get_object(Bucket=self.bucket, Key=name)["Body"]
            return body.read()

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True

    def size(self, key: str) -> int:
        name = self._name(key)
        with self._s3_errors(key, "size"):
            return int(self._client.head_object(Bucket=self.bucket, Key=name)["ContentLength"])

    def list(self, prefix: str) -> list[str]:
        validate_prefix(prefix)
        keys = []
        with self._s3_errors(prefix, "list"):
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for item in page.get("Contents", []):
                    key = item["Key"][len(self.prefix) :]
                    if not _is_reserved(key):
                        keys.append(key)
        return sorted(keys)

    def total_size(self) -> int:
        """Bytes of every object under the store's prefix (what a storage budget counts), reserved names left out:
        the listing's sizes, 1,000 objects a request."""
        total = 0
        with self._s3_errors("", "total_size"):
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
                for item in page.get("Contents", []):
                    if not _is_reserved(item["Key"][len(self.prefix) :]):
                        total += int(item["Size"])
        return total

    def delete(self, key: str) -> None:
        name = self._name(key)
        with self._s3_errors(key, "delete"):
            self._client.delete_object(Bucket=self.bucket, Key=name)

    def delete_many(self, keys: Sequence[str]) -> None:
        """DeleteObjects, up to S3_DELETE_BATCH keys a request; a key any request could not delete raises."""
        for start in range(0, len(keys), S3_DELETE_BATCH):
            batch = keys[start : start + S3_DELETE_BATCH]
            with self._s3_errors(batch[0], f"delete_objects ({len(batch)} keys from)"):
                reply = self._client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": self._name(key)} for key in batch], "Quiet": True},
                )
            errors = reply.get("Errors", [])
            if errors:  # the request went through, some keys did not: a missing key is no error in S3
                first = errors[0]
                what = f"s3 delete_objects {self.bucket}: {len(errors)} of {len(batch)} keys not deleted"
                detail = f"{first.get('Key')}: {first.get('Code')}: {first.get('Message', '')}"
                if first.get("Code") in _THROTTLED_CODES or first.get("Code") in _CREDENTIAL_CODES:
                    raise StorageUnavailable(f"{what}, e.g. {detail}")
                raise StorageRejected(f"{what}, e.g. {detail}")

    def check(self) -> None:
        where = f"bucket {self.bucket!r} at {self.endpoint_url or 'AWS'}"
        with self._s3_errors("", "check"):
            try:
                self._client.head_bucket(Bucket=self.bucket)
            except ClientError as exc:
                code, status = _error_code(exc)
                if code in ("NoSuchBucket", "NotFound", "404") or status == 404:
                    raise StorageUnavailable(
                        f"{where} does not exist: create it (e.g. `aws s3 mb s3://{self.bucket}`) "
                        f"or fix EAGLE3_STORAGE_URL / EAGLE3_S3_ENDPOINT_URL"
                    ) from exc
                raise
            # head_bucket can pass with read-only credentials; a job needs to write.
            probe = f"{self.prefix}{RESERVED_PREFIX}check-{uuid.uuid4().hex}"
            self._client.put_object(Bucket=self.bucket, Key=probe, Body=b"ok")
            self._client.delete_object(Bucket=self.bucket, Key=probe)

    def _name(self, key: str) -> str:
        return self.prefix + validate_key(key)

    def _part_bytes(self, size_bytes: int) -> int:
        return max(self.multipart_chunk_bytes, S3_MIN_PART_BYTES, math.ceil(size_bytes / S3_MAX_PARTS))

    def _still_ours(self, name: str, etag: str) -> bool:
        """Servers that check If-None-Match before writing rather than atomically (SeaweedFS) can let two concurrent
        creates both succeed, the later replacing the earlier: the earlier then reads another ETag here and reports
        that it did not create the object. AWS S3 and MinIO decide atomically and this check always passes."""
        return self._client.head_object(Bucket=self.bucket, Key=name)["ETag"] == etag

    def _put_multipart_if_absent(self, name: str, data: bytes) -> str:
        """Upload parts in parallel, then CompleteMultipartUpload with If-None-Match: * (the transfer manager
        cannot pass it). Raises ClientError PreconditionFailed when the key exists; aborts the upload on any failure
        so no parts are left billed and invisible."""
        client = self._client
        part_bytes = self._part_bytes(len(data))
        upload_id = client.create_multipart_upload(Bucket=self.bucket, Key=name)["UploadId"]
        try:

            def upload_part(part_number: int) -> dict[str, Any]:
                offset = (part_number - 1) * part_bytes
                # Slice inside the worker so at most max_concurrency part copies exist at once.
                body = data[offset : offset + part_bytes]
                response = client.upload_part(
                    Bucket=self.bucket, Key=name, UploadId=upload_id, PartNumber=part_number, Body=body
                )
                return {"PartNumber": part_number, "ETag": response["ETag"]}

            part_numbers = range(1, math.ceil(len(data) / part_bytes) + 1)
            with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(part_numbers))) as pool:
                parts = list(pool.map(upload_part, part_numbers))
            completed = client.complete_multipart_upload(
                Bucket=self.bucket, Key=name, UploadId=upload_id, MultipartUpload={"Parts": parts}, IfNoneMatch="*"
            )
            logger.debug("s3 multipart create-only key=%s parts=%d bytes=%d", name, len(parts), len(data))
            return completed["ETag"]
        except BaseException:
            try:
                client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload_id)
            except Exception as abort_exc:  # the original error matters more; a lifecycle rule sweeps leftovers
                logger.warning("s3 abort_multipart_upload failed key=%s upload_id=%s: %s", name, upload_id, abort_exc)
            raise

    @contextmanager
    def _s3_errors(self, key: str, op: str) -> Iterator[None]:
        """Translate botocore errors into ours: outages -> StorageUnavailable, 404 -> ObjectNotFound."""
        what = f"s3 {op} {self.bucket}/{self.prefix}{key}"
        try:
            yield
        except ClientError as exc:
            code, status = _error_code(exc)
            message = exc.response.get("Error", {}).get("Message", "")
            if code in ("NoSuchKey", "NotFound") or (status == 404 and code in ("404", "")):
                raise ObjectNotFound(key, self.url) from None
            if code == "NoSuchBucket":
                raise StorageUnavailable(
                    f"{what}: bucket {self.bucket!r} does not exist at {self.endpoint_url or 'AWS'}: create it "
                    f"or fix EAGLE3_STORAGE_URL"
                ) from exc
            # Before the 403 test: some servers answer QuotaExceeded with 403.
            if code in _FULL_CODES or status == 507:
                raise StorageFull(f"{what}: storage full ({code}: {message})") from exc
            if code in _THROTTLED_CODES or status in (500, 502, 503, 504):
                raise StorageUnavailable(f"{what}: throttled or unavailable ({code}, HTTP {status})") from exc
            if code in _CREDENTIAL_CODES or status == 403:
                raise StorageUnavailable(
                    f"{what}: access denied ({code}): check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the "
                    f"bucket policy (needs s3:GetObject, s3:PutObject, s3:ListBucket, s3:DeleteObject)"
                ) from exc
            raise StorageRejected(f"{what}: {code} (HTTP {status}): {message}") from exc
        except (ConnectionError, HTTPClientError, IncompleteReadError) as exc:
            raise StorageUnavailable(f"{what}: cannot reach {self.endpoint_url or 'AWS S3'}: {exc}") from exc
        except (NoCredentialsError, PartialCredentialsError) as exc:
            raise StorageUnavailable(
                f"{what}: no usable S3 credentials ({exc}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            ) from exc


def _error_code(exc: ClientError) -> tuple[str, int]:
    """(error code, HTTP status) of a botocore ClientError; HEAD answers carry only the status as code."""
    code = exc.response.get("Error", {}).get("Code", "")
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(code), int(status)

"""shared.storage.objects against a real directory and a real S3 server (SeaweedFS): the same behaviour from both."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from botocore.stub import Stubber

from shared.errors import Eagle3Error, StorageUnavailable
from shared.settings import Settings
from shared.storage.objects import (
    FileStorage,
    HashingWriter,
    InvalidKey,
    ObjectDigest,
    ObjectNotFound,
    S3Storage,
    Storage,
    StorageRejected,
    open_storage,
)
from tests.fixtures.processes import free_port

if TYPE_CHECKING:
    # Imported as a plugin below; importing it here first would bypass pytest's assertion rewriting of the module.
    from tests.fixtures.seaweedfs import S3Server


MiB = 1024 * 1024
# S3's minimum part size; a 12 MiB object then takes the multipart path in 3 parts (5 + 5 + 2 MiB).
SMALL_THRESHOLD_BYTES = 5 * MiB
MULTIPART_BYTES = 12 * MiB


def small_threshold_settings() -> Settings:
    # Settings() reads EAGLE3_S3_* from the environment that s3_storage_url sets for the test.
    return Settings(
        s3_multipart_threshold_bytes=SMALL_THRESHOLD_BYTES, s3_multipart_chunk_bytes=5 * MiB, s3_max_concurrency=4
    )


@pytest.fixture(params=[pytest.param("file", id="file"), pytest.param("s3", id="s3")])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "file":
        return open_storage((tmp_path / "root").as_uri())
    return open_storage(request.getfixturevalue("s3_storage_url"), small_threshold_settings())


def payload(tag: int, size_bytes: int) -> bytes:
    """Distinct, recognisable content per writer: a torn mix of two writers cannot equal either."""
    return bytes([tag % 256]) * size_bytes


def assert_one_creator_is_stored(storage: Storage, key: str, payloads: list[bytes], created: list[bool]) -> None:
    stored = storage.get(key)
    assert stored in payloads, "torn object"
    assert created[payloads.index(stored)], f"the stored object's writer was told it lost: {created}"
    if isinstance(storage, FileStorage):
        assert created.count(True) == 1, created
    else:
        # SeaweedFS checks If-None-Match before writing: simultaneous creates can both land, and an earlier writer
        # whose ETag check ran before the later write landed is told True as well (AWS S3 decides atomically).
        assert created.count(True) >= 1, created


def race(n_threads: int, write: Callable[[int], bool]) -> list[bool]:
    """Run write(i) in n threads released at the same moment; the results in thread order."""
    barrier = threading.Barrier(n_threads)
    results: list[bool | BaseException] = [False] * n_threads

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = write(i)
        except BaseException as exc:  # reported below, with the thread's index
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert not errors, errors
    return [bool(r) for r in results]


# ---------------------------------------------------------------------------------------------------------------------
# The same behaviour from both backends


def test_round_trip(storage: Storage) -> None:
    key = "job-1/rows_0-2000/data_0.pt"
    assert not storage.exists(key)
    storage.put(key, b"first")
    assert storage.get(key) == b"first"
    assert storage.exists(key)
    assert storage.size(key) == 5
    storage.put(key, b"overwritten")  # put overwrites
    assert storage.get(key) == b"overwritten"
    storage.delete(key)
    assert not storage.exists(key)
    storage.delete(key)  # deleting a missing object is not an error
    storage.check()


def test_empty_object_round_trips(storage: Storage) -> None:
    storage.put("job-1/empty", b"")
    assert storage.get("job-1/empty") == b""
    assert storage.size("job-1/empty") == 0


def test_put_if_absent_keeps_first_content(storage: Storage) -> None:
    key = "job-1/manifests/shard_000000.json"
    assert storage.put_if_absent(key, b'{"writer": 1}') is True
    assert storage.put_if_absent(key, b'{"writer": 2}') is False
    assert storage.get(key) == b'{"writer": 1}'


def test_put_if_absent_from_stores_the_stream_and_its_digest(storage: Storage) -> None:
    key = "job-1/samples/000000.pt"
    chunks = [payload(1, 3 * MiB), payload(2, 1), memoryview(payload(3, 5000))]  # the shapes torch.save hands over

    digest = storage.put_if_absent_from(key, lambda out: [out.write(chunk) for chunk in chunks])
    again = storage.put_if_absent_from(key, lambda out: out.write(b"second writer"))

    stored = storage.get(key)
    assert stored == b"".join(bytes(chunk) for chunk in chunks)
    assert digest == ObjectDigest.of(stored)
    assert again is None  # create-only: the first stream stays
    assert storage.get(key) == stored


def test_a_stream_that_fails_creates_nothing(storage: Storage) -> None:
    def fail_halfway(out: HashingWriter) -> None:
        out.write(payload(4, MiB))
        raise RuntimeError("torch.save failed")

    with pytest.raises(RuntimeError, match=r"torch\.save failed"):
        storage.put_if_absent_from("job-1/samples/000001.pt", fail_halfway)

    assert not storage.exists("job-1/samples/000001.pt")
    assert storage.list("job-1/") == []


def test_concurrent_put_if_absent_has_one_winner(storage: Storage) -> None:
    key = "job-1/manifests/shard_000001.json"
    payloads = [payload(i, 256 * 1024) for i in range(8)]
    created = race(8, lambda i: storage.put_if_absent(key, payloads[i]))
    assert_one_creator_is_stored(storage, key, payloads, created)


def test_multipart_put_if_absent_is_create_only(storage: Storage) -> None:
    key = "job-1/rows_0-2000/data_1.pt"
    first, second = payload(1, MULTIPART_BYTES), payload(2, MULTIPART_BYTES)
    assert storage.put_if_absent(key, first) is True
    assert storage.put_if_absent(key, second) is False  # the conflict is detected at CompleteMultipartUpload
    assert storage.get(key) == first
    assert storage.size(key) == MULTIPART_BYTES


def test_concurrent_multipart_put_if_absent_has_one_winner(storage: Storage) -> None:
    key = "job-1/rows_0-2000/data_2.pt"
    payloads = [payload(10 + i, MULTIPART_BYTES) for i in range(3)]
    created = race(3, lambda i: storage.put_if_absent(key, payloads[i]))
    assert_one_creator_is_stored(storage, key, payloads, created)


def test_multipart_put_overwrites(storage: Storage) -> None:
    key = "job-1/vocab_mapping.pt"
    storage.put(key, payload(3, MULTIPART_BYTES))
    storage.put(key, payload(4, MULTIPART_BYTES + 1))
    assert storage.get(key) == payload(4, MULTIPART_BYTES + 1)


def test_list_is_sorted_recursive_and_scoped_to_the_prefix(storage: Storage) -> None:
    keys = [
        "job-1/manifests/shard_000001.json",
        "job-1/job.json",
        "job-1/manifests/shard_000000.json",
        "job-1/rows_0-2000/data_0.pt",
        "job-10/job.json",  # a sibling whose name starts with the same characters
        "job-1x",
    ]
    for key in keys:
        storage.put(key, b"x")
    assert storage.list("job-1/") == [
        "job-1/job.json",
        "job-1/manifests/shard_000000.json",
        "job-1/manifests/shard_000001.json",
        "job-1/rows_0-2000/data_0.pt",
    ]
    assert storage.list("job-1/manifests/") == [
        "job-1/manifests/shard_000000.json",
        "job-1/manifests/shard_000001.json",
    ]
    assert storage.list("job-1/manifests/shard_000001") == ["job-1/manifests/shard_000001.json"]
    assert storage.list("job-2/") == []
    assert storage.list("") == sorted(keys)


def test_missing_object_raises_object_not_found(storage: Storage) -> None:
    with pytest.raises(ObjectNotFound, match="job-1/missing") as info:
        storage.get("job-1/missing")
    assert isinstance(info.value, KeyError) and isinstance(info.value, Eagle3Error)
    assert info.value.key == "job-1/missing"
    with pytest.raises(ObjectNotFound):
        storage.size("job-1/missing")
    assert not storage.exists("job-1/missing")


@pytest.mark.parametrize(
    "key",
    [
        pytest.param("", id="empty"),
        pytest.param("/job-1/job.json", id="absolute"),
        pytest.param("job-1/../job-2/job.json", id="dotdot"),
        pytest.param("..", id="only-dotdot"),
        pytest.param("job-1//job.json", id="empty-segment"),
        pytest.param("job-1/./job.json", id="dot"),
        pytest.param("job-1/", id="trailing-slash"),
        pytest.param("job-1/.eagle3-check-1", id="reserved-name"),
    ],
)
def test_invalid_keys_are_rejected(storage: Storage, key: str) -> None:
    with pytest.raises(InvalidKey):
        storage.put(key, b"x")
    with pytest.raises(InvalidKey):
        storage.put_if_absent(key, b"x")
    with pytest.raises(InvalidKey):
        storage.get(key)
    with pytest.raises(InvalidKey):
        storage.delete(key)


@pytest.mark.parametrize("prefix", ["/job-1/", "job-1/../", "..", "job-1//"])
def test_invalid_list_prefixes_are_rejected(storage: Storage, prefix: str) -> None:
    with pytest.raises(InvalidKey):
        storage.list(prefix)


# ---------------------------------------------------------------------------------------------------------------------
# File backend


def test_file_storage_accepts_a_plain_path(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "root"))
    assert isinstance(storage, FileStorage)
    assert storage.url == (tmp_path / "root").as_uri()
    storage.put("job-1/job.json", b"{}")
    assert (tmp_path / "root" / "job-1" / "job.json").read_bytes() == b"{}"


def test_file_storage_leaves_no_temp_files(tmp_path: Path) -> None:
    storage = open_storage((tmp_path / "root").as_uri())
    storage.put("job-1/a", b"1")
    storage.put_if_absent("job-1/b", b"2")
    storage.put_if_absent("job-1/b", b"3")
    storage.put_if_absent_from("job-1/c", lambda out: out.write(b"4"))
    storage.put_if_absent_from("job-1/c", lambda out: out.write(b"5"))
    storage.check()
    assert sorted(p.name for p in (tmp_path / "root" / "job-1").iterdir()) == ["a", "b", "c"]
    assert list((tmp_path / "root").iterdir()) == [tmp_path / "root" / "job-1"]


@pytest.mark.parametrize(
    ("method", "content"),
    [
        pytest.param("put", b"data", id="put"),
        pytest.param("put_if_absent", b"data", id="put_if_absent"),
        pytest.param("put_if_absent_from", lambda out: out.write(b"data"), id="put_if_absent_from"),
    ],
)
def test_file_storage_disk_full_is_storage_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str, content: object
) -> None:
    # No tmpfs can be mounted here, so ENOSPC is simulated at os.write; this checks the mapping and the cleanup.
    storage = open_storage((tmp_path / "root").as_uri())
    storage.put("job-1/old", b"kept")

    def write_enospc(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", write_enospc)
    with pytest.raises(StorageUnavailable, match=r"job-1/new.*disk full"):
        getattr(storage, method)("job-1/new", content)
    with pytest.raises(StorageUnavailable, match="disk full"):
        storage.check()
    monkeypatch.undo()
    assert storage.list("") == ["job-1/old"]
    assert sorted(p.name for p in (tmp_path / "root" / "job-1").iterdir()) == ["old"]


def test_file_storage_check_fails_when_root_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "root").write_bytes(b"not a directory")
    with pytest.raises(StorageUnavailable, match="not writable"):
        open_storage((tmp_path / "root").as_uri()).check()


# ---------------------------------------------------------------------------------------------------------------------
# S3 backend


def test_s3_create_only_leaves_no_open_multipart_uploads(s3_server: S3Server, s3_storage_url: str) -> None:
    storage = open_storage(s3_storage_url, small_threshold_settings())
    assert isinstance(storage, S3Storage)
    storage.put_if_absent("job-1/big", payload(5, MULTIPART_BYTES))
    storage.put_if_absent("job-1/big", payload(6, MULTIPART_BYTES))  # refused at complete, then aborted
    uploads = s3_server.client().list_multipart_uploads(Bucket=s3_server.bucket, Prefix=storage.prefix)
    assert uploads.get("Uploads", []) == []


def test_s3_unreachable_endpoint_is_storage_unavailable_within_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "unused")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "unused")
    closed_port = free_port()  # nothing listens there: connection refused
    storage = open_storage("s3://eagle3-test/x", Settings(s3_endpoint_url=f"http://127.0.0.1:{closed_port}"))
    for call in (storage.check, lambda: storage.put("job-1/job.json", b"{}")):
        start = time.monotonic()
        with pytest.raises(StorageUnavailable, match=f"cannot reach http://127.0.0.1:{closed_port}"):
            call()
        assert time.monotonic() - start < 10


def test_s3_missing_bucket_check_says_what_to_fix(s3_server: S3Server, s3_storage_url: str) -> None:
    storage = open_storage("s3://eagle3-no-such-bucket/x", Settings())
    with pytest.raises(StorageUnavailable, match=r"'eagle3-no-such-bucket'.*does not exist: create it"):
        storage.check()
    with pytest.raises(StorageUnavailable, match="does not exist"):
        storage.put("job-1/job.json", b"{}")


def test_s3_wrong_credentials_check_says_what_to_fix(
    s3_server: S3Server, s3_storage_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    storage = open_storage(s3_storage_url, Settings())
    with pytest.raises(StorageUnavailable, match="AWS_SECRET_ACCESS_KEY"):
        storage.check()


# Answers SeaweedFS does not give on demand, played back by botocore's Stubber (no network, no retry sleeps).


@pytest.fixture
def stubbed_s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[S3Storage, Stubber]]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "unused")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "unused")
    storage = S3Storage("s3://eagle3-test/root", Settings(s3_endpoint_url="http://127.0.0.1:9"))
    stubber = Stubber(storage._client)
    stubber.activate()
    monkeypatch.setattr("shared.storage.objects.time.sleep", lambda s: None)
    yield storage, stubber
    stubber.deactivate()


def test_s3_conditional_request_conflict_is_retried(stubbed_s3: tuple[S3Storage, Stubber]) -> None:
    storage, stubber = stubbed_s3
    stubber.add_client_error("put_object", "ConditionalRequestConflict", http_status_code=409)
    stubber.add_response("put_object", {"ETag": '"1"'})
    stubber.add_response("head_object", {"ETag": '"1"', "ContentLength": 2})
    assert storage.put_if_absent("job-1/manifests/shard_000000.json", b"{}") is True
    stubber.assert_no_pending_responses()


def test_s3_create_replaced_by_a_concurrent_create_reports_it_lost(stubbed_s3: tuple[S3Storage, Stubber]) -> None:
    # A server with a non-atomic precondition check accepted both creates; the other writer's object is stored.
    storage, stubber = stubbed_s3
    stubber.add_response("put_object", {"ETag": '"ours"'})
    stubber.add_response("head_object", {"ETag": '"theirs"', "ContentLength": 2})
    assert storage.put_if_absent("job-1/manifests/shard_000000.json", b"{}") is False
    stubber.assert_no_pending_responses()


@pytest.mark.parametrize(
    ("code", "status", "error", "match"),
    [
        pytest.param("SlowDown", 503, StorageUnavailable, "throttled", id="slow-down"),
        pytest.param("RequestTimeout", 400, StorageUnavailable, "throttled", id="request-timeout"),
        pytest.param("InsufficientStorage", 507, StorageUnavailable, "storage full", id="insufficient-storage"),
        pytest.param("QuotaExceeded", 403, StorageUnavailable, "storage full", id="quota-exceeded"),
        pytest.param("EntityTooLarge", 400, StorageRejected, "EntityTooLarge", id="entity-too-large"),
    ],
)
def test_s3_errors_are_classified(
    stubbed_s3: tuple[S3Storage, Stubber], code: str, status: int, error: type[Exception], match: str
) -> None:
    storage, stubber = stubbed_s3
    stubber.add_client_error("put_object", code, http_status_code=status)
    with pytest.raises(error, match=match) as info:
        storage.put("job-1/rows_0-2000/data_0.pt", b"x")
    assert "job-1/rows_0-2000/data_0.pt" in str(info.value)

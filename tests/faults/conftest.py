import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

from eagle3.local_stack import LocalStack
from shared.data.demo_data import write_demo_dataset
from shared.settings import Settings
from shared.storage.objects import open_storage
from tests.faults import report
from tests.faults.stack import FaultStack
from tests.fixtures.processes import free_port
from tests.fixtures.seaweedfs import ACCESS_KEY, SECRET_KEY, S3Server, WeedMini

MakeStack = Callable[..., AbstractContextManager[FaultStack]]


@pytest.fixture
def fault_table(request: pytest.FixtureRequest) -> Callable[..., report.Row]:
    """Record this scenario's row of the fault table."""

    def record(scenario: str, **fields: object) -> report.Row:
        row = report.Row(scenario, **fields)  # type: ignore[arg-type]
        report.record(request.node.nodeid, row)
        return row

    return record


@pytest.fixture(scope="session")
def chats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 demo conversations (SmolLM2 tokens: about 10k)."""
    return write_demo_dataset(tmp_path_factory.mktemp("chats") / "chats.jsonl", num_conversations=60)


def own_weed_env(tmp_path: Path) -> dict[str, str]:
    # TMPDIR: weed writes its glog files there, in the test's folder rather than /tmp.
    return {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "TMPDIR": str(tmp_path)}


@pytest.fixture
def own_weed(tmp_path: Path) -> Iterator[WeedMini]:
    """A SeaweedFS of this test's own, which the test may stop and start again (the session's serves the others)."""
    run_dir = tmp_path / "weed"
    run_dir.mkdir()
    weed = WeedMini.plan(run_dir)
    weed.start(own_weed_env(tmp_path), tmp_path / "weed.log")
    try:
        yield weed
    finally:
        weed.stop()


@pytest.fixture
def make_stack(
    smollm2_dir: Path,
    s3_server: S3Server,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[MakeStack]:
    """`with make_stack(workers=2) as stack:` a fresh stack on the session's S3 server (or the one given as `s3`);
    Redis is started by the stack (append-only file on, as compose configures it) unless `redis_url` names one
    already running."""
    for name, value in s3_server.env().items():
        if name.startswith("AWS_"):  # credentials for boto3 here and in every child process
            monkeypatch.setenv(name, value)

    @contextmanager
    def make(
        *, workers: int = 2, redis_url: str | None = None, s3: S3Server | None = None, **overrides: object
    ) -> Iterator[FaultStack]:
        s3 = s3 or s3_server
        home = tmp_path / f"home-{uuid.uuid4().hex[:6]}"
        fields: dict[str, object] = {
            "redis_url": redis_url or f"redis://127.0.0.1:{free_port()}/0",
            "storage_url": f"s3://{s3.bucket}/faults-{uuid.uuid4().hex[:8]}",
            "s3_endpoint_url": s3.endpoint_url,
            "model_path": smollm2_dir,
            "home": home,
            "inference_device": "cpu",
            "worker_heartbeat_file": home / "heartbeat",
            # The scenarios' datasets are local files under the session's temporary folder (shared/access.py).
            "dataset_roots": [str(tmp_path_factory.getbasetemp())],
        }
        settings = Settings(**{**fields, **overrides})  # type: ignore[arg-type]
        with LocalStack(settings, workers=workers, log_dir=home / "logs", pick_free_ports=True) as stack:
            # The test reads storage directly, never through a fault proxy the stack may be given.
            direct = settings.model_copy(update={"s3_endpoint_url": s3.endpoint_url})
            yield FaultStack(stack, settings, open_storage(settings.storage_url, direct))

    yield make

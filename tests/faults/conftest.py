import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from eagle3.local_stack import LocalStack
from shared.demo_data import write_demo_dataset
from shared.settings import Settings
from shared.storage import open_storage
from tests.faults import report
from tests.faults.stack import FaultStack
from tests.fixtures.processes import free_port

if TYPE_CHECKING:
    from tests.fixtures.seaweedfs import S3Server

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


@pytest.fixture
def make_stack(
    smollm2_dir: Path, s3_server: "S3Server", tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[MakeStack]:
    """`with make_stack(workers=2) as stack:` a fresh stack; Redis is started by the stack (append-only file on,
    as compose configures it) unless `redis_url` names one already running."""
    for name, value in s3_server.env().items():
        if name.startswith("AWS_"):  # credentials for boto3 here and in every child process
            monkeypatch.setenv(name, value)

    @contextmanager
    def make(*, workers: int = 2, redis_url: str | None = None, **overrides: object) -> Iterator[FaultStack]:
        home = tmp_path / f"home-{uuid.uuid4().hex[:6]}"
        fields: dict[str, object] = {
            "redis_url": redis_url or f"redis://127.0.0.1:{free_port()}/0",
            "storage_url": f"s3://{s3_server.bucket}/faults-{uuid.uuid4().hex[:8]}",
            "s3_endpoint_url": s3_server.endpoint_url,
            "model_path": smollm2_dir,
            "home": home,
            "inference_device": "cpu",
            "worker_heartbeat_file": home / "heartbeat",
        }
        settings = Settings(**{**fields, **overrides})  # type: ignore[arg-type]
        with LocalStack(settings, workers=workers, log_dir=home / "logs", pick_free_ports=True) as stack:
            # The test reads storage directly, never through a fault proxy the stack may be given.
            direct = settings.model_copy(update={"s3_endpoint_url": s3_server.endpoint_url})
            yield FaultStack(stack, settings, open_storage(settings.storage_url, direct))

    yield make

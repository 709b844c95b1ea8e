from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.deployment import Deployment, deploy


@pytest.fixture(scope="module")
def deployment(
    tiny_model_dir: Path, redis_server: str, s3_server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    """The stack of one test module, with two capture requests in flight per worker (a module may deploy its own)."""
    home = tmp_path_factory.mktemp("home")
    with deploy(s3_server, redis_server, tiny_model_dir, home, inference_concurrency=2) as d:
        yield d

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.builders import build_tiny_llama

# Fixture modules, registered once for the whole suite; a fixture starts its server only when a test asks for it.
pytest_plugins = [
    "tests.fixtures.redis_server",
    "tests.fixtures.reference_server",
    "tests.fixtures.seaweedfs",
    "tests.fixtures.smollm2",
    "tests.trainer.trainer_fixtures",
]


# A test that asks for one of these starts an inference server, a whole stack or the real model: it is slow
# (`make test-fast` leaves it out) whatever its module says.
SERVER_FIXTURES = {"reference_server_url", "server", "extracted_job", "smollm2_dir", "deployment"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A random 8-layer Llama (hidden 64) with a ChatML tokenizer; default aux layer ids [1, 3, 4]."""
    yield build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))

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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A random 8-layer Llama (hidden 64) with a ChatML tokenizer; default aux layer ids [1, 3, 4]."""
    yield build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))

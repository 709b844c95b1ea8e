from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.builders import build_tiny_llama
from tests.fixtures import step_timings

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


# The longest modules, run first: minutes each (the live cluster, the compose stack, the short chaos soak), mostly
# waiting on pods, containers and faults, so that under pytest-xdist (`make test`: a module per worker
# at a time) they start early beside the rest of the suite instead of ending it.
FIRST = ("tests/k8s/", "tests/compose/", "tests/soak/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)

    def rank(item: pytest.Item) -> int:
        return next((i for i, prefix in enumerate(FIRST) if item.nodeid.startswith(prefix)), len(FIRST))

    items.sort(key=rank)  # stable: the order within each part stays


# Packages whose fixtures are package-scoped (tests/ops: one live stack and its jobs for all its modules), each handed
# to one pytest-xdist worker as a single unit: split by module, as loadscope does, every worker that got one of the
# modules built the stack again (11-17 s of setup each, and its teardown).
ONE_UNIT = ("tests/ops/",)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, in its controller
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    if config.getvalue("dist") != "loadscope":
        return None  # xdist's own scheduler for the mode asked for
    from xdist.scheduler import LoadScopeScheduling

    class PackageUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            package = next((prefix for prefix in ONE_UNIT if nodeid.startswith(prefix)), None)
            return package if package is not None else super()._split_scope(nodeid)

    return PackageUnitScheduling(config, log)


def pytest_sessionfinish(session: pytest.Session) -> None:
    step_timings.hand_to_controller(session.config)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, in its controller
def pytest_testnodedown(node: object, error: object) -> None:
    step_timings.take_from_worker(getattr(node, "workeroutput", {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    step_timings.print_tables(terminalreporter)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A random 8-layer Llama (hidden 64) with a ChatML tokenizer; default aux layer ids [1, 3, 4]."""
    yield build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))

"""The compose end-to-end test runs only where a Docker daemon answers (`.ci/run` starts one with the container
engine script when the machine has it); elsewhere it is skipped with the reason. Its timings print at the end."""

import shutil
import subprocess

import pytest

from tests.fixtures import step_timings

# Filled by the tests: what each step of the real engine took, printed in the terminal summary.
TIMINGS_S = step_timings.table("docker compose on a real engine: seconds per step")


def docker_unavailable_reason() -> str | None:
    """Why the compose test cannot run here, or None when a daemon and the Compose v2 plugin answer."""
    docker = shutil.which("docker")
    if docker is None:
        return "no docker CLI on PATH (CI starts one with ../shared/tools/container-engine/container-engine.sh setup)"
    try:
        server = subprocess.run(
            [docker, "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True, timeout=20
        )
        plugin = subprocess.run([docker, "compose", "version", "--short"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "the Docker daemon does not answer within 20 s"
    if server.returncode != 0 or not server.stdout.strip():
        return f"no Docker daemon answers: {server.stderr.strip()[:200]}"
    if plugin.returncode != 0:
        return f"no Docker Compose v2 plugin (`docker compose`): {plugin.stderr.strip()[:200]}"
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "compose: builds the images and runs docker-compose.yml on a real Docker engine")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if item.get_closest_marker("compose")]
    if not ours:
        return
    reason = docker_unavailable_reason()
    if reason is not None:
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=reason))

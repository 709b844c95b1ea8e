"""The Dockerfiles, without a Docker engine: parsed here, linted by hadolint, and their inputs checked to exist."""

import http.server
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.tools import (
    DOCKERFILE,
    REPO,
    dockerignore_patterns,
    dockerignored,
    effective,
    parse_dockerfile,
    project_dockerfiles,
    run,
    tool,
)
from tests.fixtures.processes import free_port

HEALTHCHECK_SCRIPT = REPO / "docker" / "healthcheck.py"


def _id(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("dockerfile", project_dockerfiles(), ids=_id)
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    # This issue's Dockerfile is held to warnings; other issues' Dockerfiles to errors (their warnings are printed).
    threshold = "warning" if dockerfile == DOCKERFILE else "error"
    result = run([tool("hadolint"), "--no-color", "--failure-threshold", threshold, dockerfile])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", project_dockerfiles(), ids=_id)
def test_dockerfile_copies_only_files_that_exist_in_its_context(dockerfile: Path) -> None:
    # Every project Dockerfile builds with the repository root as its context (docker-compose.yml, k8s docs).
    _, stages = parse_dockerfile(dockerfile)
    patterns = dockerignore_patterns(dockerfile)
    stage_names = {s.name for s in stages}
    copied = 0
    for stage in stages:
        for instruction in stage.instructions:
            if instruction.keyword not in ("COPY", "ADD") or instruction.flags().get("from"):
                continue
            *sources, _ = instruction.words()
            for source in sources:
                assert "://" not in source, f"{_id(dockerfile)}:{instruction.line}: ADD from a URL"
                matches = list(REPO.glob(source)) if any(c in source for c in "*?[") else [REPO / source]
                assert matches and all(m.exists() for m in matches), f"{_id(dockerfile)}:{instruction.line}: {source}"
                assert not dockerignored(source, patterns), f"{_id(dockerfile)}:{instruction.line}: {source} ignored"
                copied += 1
    assert copied, "copies nothing from the context"
    assert stage_names  # multi-stage, named


@pytest.mark.parametrize("dockerfile", project_dockerfiles(), ids=_id)
def test_dockerfile_runs_as_non_root(dockerfile: Path) -> None:
    _, stages = parse_dockerfile(dockerfile)
    referenced = {s.base for s in stages} | {
        i.flags()["from"] for s in stages for i in s.instructions if i.keyword == "COPY" and "from" in i.flags()
    }
    # Stages that end up as images: the last one, and every named stage no later stage builds on (a target).
    finals = [s for s in stages if s is stages[-1] or (s.name and s.name not in referenced)]
    for stage in finals:
        user = effective(stages, stage, "USER")
        assert user is not None, f"{_id(dockerfile)} stage {stage.name}: no USER, runs as root"
        name = user.args.split(":")[0].strip()
        assert name not in ("root", "0"), f"{_id(dockerfile)} stage {stage.name}: USER {user.args}"


def test_base_images_are_pinned() -> None:
    global_args, stages = parse_dockerfile(DOCKERFILE)
    names = {s.name for s in stages}
    for stage in stages:
        base = stage.base
        if base in names:
            continue
        if base.startswith("${") and base.endswith("}"):
            base = global_args[base[2:-1]]
        _, _, tag = base.partition(":")
        assert tag and tag != "latest", f"stage {stage.name}: base {base} is not pinned"
        assert "slim" in tag, f"stage {stage.name}: {base} is not a slim image"


def test_dockerfile_builds_with_the_engines_own_frontend() -> None:
    # A `# syntax=` parser directive makes every build fetch that frontend image from a registry first.
    first = DOCKERFILE.read_text().splitlines()[0]
    assert not re.match(r"#\s*syntax\s*=", first, flags=re.IGNORECASE), f"parser directive: {first}"


def test_torch_comes_from_a_configurable_cpu_index() -> None:
    # torch is installed once, before the other dependencies (which then find it), from TORCH_INDEX_URL:
    # the PyTorch CPU index by default, a mirror, or empty for pip's own settings (a wheelhouse).
    _, stages = parse_dockerfile(DOCKERFILE)
    runs = [i for s in stages for i in s.instructions if i.keyword == "RUN" and "pip install" in i.args]
    torch_runs = [i for i in runs if "torch==" in i.args]
    assert len(torch_runs) == 1 and runs.index(torch_runs[0]) == 0
    assert '${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}' in torch_runs[0].args
    (deps,) = [s for s in stages if s.name == "deps"]
    args = dict(i.args.partition("=")[::2] for i in deps.instructions if i.keyword == "ARG")
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert {"PIP_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"} <= set(args)
    # docker/wheels, the optional local wheelhouse, is mounted wherever pip installs.
    assert all("--mount=type=bind,source=docker/wheels,target=/wheels" in i.args for i in runs)
    assert (REPO / "docker" / "wheels").is_dir()
    assert not dockerignored("docker/wheels/torch.whl", dockerignore_patterns(DOCKERFILE))


def _final_stage() -> tuple[list, object]:
    _, stages = parse_dockerfile(DOCKERFILE)
    assert stages[-1].name == "eagle3", "the last stage is the image: docker build without --target builds it"
    return stages, stages[-1]


def test_one_image_runs_every_service_with_a_healthcheck() -> None:
    stages, image = _final_stage()
    assert [s.name for s in stages] == ["requirements", "deps", "project", "runtime-env", "eagle3"]
    cmd = effective(stages, image, "CMD")
    assert cmd is not None and cmd.args.lstrip().startswith("["), "CMD must be exec form"
    assert cmd.words() == ["eagle3", "--help"]
    check = effective(stages, image, "HEALTHCHECK")
    assert check is not None and check.words()[0] == "CMD"
    probe = json.loads(check.args[check.args.index("CMD") + 3 :].strip())
    assert probe == ["python", "/usr/local/lib/eagle3/healthcheck.py", "auto"]
    copied = [i for i in image.instructions if i.keyword == "COPY" and "healthcheck.py" in i.args]
    assert copied and copied[0].words()[-1] == probe[1]
    # Nothing is installed in the image stage: it copies the finished environment (without pip), then the
    # project over it as a layer of its own (a source change ships that small layer only).
    assert not [i for i in image.instructions if i.keyword == "RUN" and re.search(r"apt-get|pip |apk ", i.args)]
    copies = [(i.flags().get("from"), i.words()) for i in image.instructions if i.keyword == "COPY"]
    assert copies[:2] == [("runtime-env", ["/opt/venv", "/opt/venv"]), ("project", ["/opt/project", "/opt/venv"])]
    (runtime_env,) = [s for s in stages if s.name == "runtime-env"]
    assert [i.args for i in runtime_env.instructions] == ["pip uninstall --yes --quiet pip"]


def test_image_remaps_sigterm_to_the_workers_soft_shutdown() -> None:
    stages, image = _final_stage()
    env = " ".join(i.args for i in image.instructions if i.keyword == "ENV")
    assert "REMAP_SIGTERM=SIGQUIT" in env
    assert effective(stages, image, "STOPSIGNAL") is None  # SIGTERM, what Docker and Kubernetes send


def test_dockerfile_environment_names_are_settings() -> None:
    from shared.settings import Settings

    names = {f"EAGLE3_{n.upper()}" for n in Settings.model_fields}
    _, stages = parse_dockerfile(DOCKERFILE)
    for stage in stages:
        for instruction in stage.instructions:
            if instruction.keyword == "ENV":
                for word in instruction.words():
                    key = word.partition("=")[0]
                    assert not key.startswith("EAGLE3_") or key in names, f"ENV {key} is not a setting"


def test_project_wheel_carries_the_files_the_services_read(tmp_path: Path) -> None:
    # The images install the project as a wheel (not editable), so data files must be declared package data.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("shared", "services", "eagle3"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist", "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "dist").glob("eagle3_factory-*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    data_files = {
        str(p.relative_to(REPO))
        for package in ("shared", "services", "eagle3")
        for p in (REPO / package).rglob("*")
        if p.is_file()
        and p.suffix not in (".py", ".pyc")
        and "__pycache__" not in p.parts
        # the SGLang plugin is its own distribution with its own pyproject.toml
        and "sglang" not in p.parts
    }
    missing = data_files - in_wheel
    assert not missing, f"not in the wheel (declare them as package data in pyproject.toml): {sorted(missing)}"


# ----------------------------------------------------------------------------------------------------------
# docker/healthcheck.py, the images' HEALTHCHECK for the HTTP services and the trainer


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[tuple[int, type[_Health]]]:
    handler = type("Handler", (_Health,), {"status": 200})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], handler
    finally:
        server.shutdown()
        server.server_close()


def _healthcheck(mode: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK_SCRIPT), mode], env=env, capture_output=True, text=True, timeout=30
    )


@pytest.mark.parametrize(("mode", "variable"), [("api", "EAGLE3_API_PORT"), ("inference", "EAGLE3_INFERENCE_PORT")])
def test_healthcheck_follows_the_health_endpoint(
    health_server: tuple[int, type[_Health]], mode: str, variable: str
) -> None:
    port, handler = health_server
    assert _healthcheck(mode, {variable: str(port)}).returncode == 0
    handler.status = 503  # loading
    result = _healthcheck(mode, {variable: str(port)})
    assert result.returncode == 1 and "503" in result.stderr
    assert _healthcheck(mode, {variable: str(free_port())}).returncode == 1  # nothing listens


def test_healthcheck_pings_redis(redis_url: str) -> None:
    assert _healthcheck("redis", {"EAGLE3_REDIS_URL": redis_url}).returncode == 0
    down = f"redis://127.0.0.1:{free_port()}/0"
    assert _healthcheck("redis", {"EAGLE3_REDIS_URL": down}).returncode == 1


def _load_healthcheck() -> Any:
    spec = importlib.util.spec_from_file_location("eagle3_healthcheck", HEALTHCHECK_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("cmdline", "command"),
    [
        pytest.param(b"/opt/venv/bin/python\0/opt/venv/bin/eagle3\0worker\0", "worker", id="console-script"),
        pytest.param(b"eagle3\0api\0", "api", id="exec-form"),
        pytest.param(b"/opt/venv/bin/python\0/opt/venv/bin/eagle3\0train\0--job\0j\0", "train", id="train"),
        pytest.param(b"redis-server\0--appendonly\0yes\0", None, id="not-eagle3"),
    ],
)
def test_auto_healthcheck_reads_the_running_eagle3_command(cmdline: bytes, command: str | None) -> None:
    assert _load_healthcheck().running_command(cmdline) == command


@pytest.mark.parametrize(("age_s", "passes"), [pytest.param(0, True, id="fresh"), pytest.param(200, False, id="stale")])
def test_worker_healthcheck_agrees_with_the_worker_probe(tmp_path: Path, age_s: float, passes: bool) -> None:
    from services.worker.heartbeat import DEFAULT_MAX_AGE_S, stale_reason
    from shared.settings import Settings

    path = tmp_path / "heartbeat"
    path.touch()
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    result = _healthcheck("worker", {"EAGLE3_WORKER_HEARTBEAT_FILE": str(path)})
    assert (result.returncode == 0) is passes is (stale_reason(path, DEFAULT_MAX_AGE_S) is None), result.stderr
    if not passes:
        assert "not consuming" in result.stderr
    missing = _healthcheck("worker", {"EAGLE3_WORKER_HEARTBEAT_FILE": str(tmp_path / "missing")})
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    # Without the variable it looks where the worker writes by default.
    module = _load_healthcheck()
    assert Path(module.WORKER_HEARTBEAT_FILE) == Settings(_env_file=None).worker_heartbeat_file
    assert module.WORKER_MAX_AGE_S == DEFAULT_MAX_AGE_S

"""docker-compose.yml and .env.example, checked with the real Docker Compose v2 binary (`config` needs no engine)."""

import re
from pathlib import Path
from typing import Any

import pytest
from dotenv import dotenv_values

from shared.settings import Settings
from tests.deploy.tools import (
    COMPOSE_FILE,
    COMPOSE_PROFILES,
    DOCKERFILE,
    EAGLE3_IMAGE,
    REPO,
    clean_env,
    compose,
    compose_config,
    parse_dockerfile,
    parse_eagle3_command,
    run,
)

ENV_EXAMPLE = REPO / ".env.example"
TRAINER_GPU_FILE = REPO / "docker" / "compose.trainer-gpu.yml"
SETTING_NAMES = {f"EAGLE3_{name.upper()}" for name in Settings.model_fields}
ALL_PROFILES = tuple(p for p in COMPOSE_PROFILES if p)


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    """The project with every profile on, as the compose binary resolves it (anchors, interpolation, defaults)."""
    return compose_config(ALL_PROFILES)


def _seconds(duration: str) -> float:
    # compose normalises durations to Go's form: "1m30s", "90s", "1h0m0s", "500ms"
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts, f"cannot read duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


@pytest.mark.parametrize("profile", COMPOSE_PROFILES, ids=lambda p: p or "no-profile")
def test_compose_file_validates_under_every_profile(profile: str) -> None:
    result = run(compose("config", "-q", profiles=(profile,) if profile else ()), env=clean_env())
    assert result.returncode == 0, result.stderr


def test_compose_file_validates_with_env_example_and_trainer_gpu_file() -> None:
    result = run(
        compose(
            "--env-file",
            str(ENV_EXAMPLE),
            "config",
            "-q",
            profiles=ALL_PROFILES,
            files=(COMPOSE_FILE, TRAINER_GPU_FILE),
        ),
        env=clean_env(),
    )
    assert result.returncode == 0, result.stderr


def test_compose_rejects_an_invalid_file(tmp_path: Path) -> None:
    # The validator really validates: an unknown service key is an error.
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  worker:\n    image: eagle3-worker\n    replicaz: 3\n")
    result = run(compose("config", "-q", files=(bad,)), env=clean_env())
    assert result.returncode != 0
    assert "replicaz" in result.stderr


def test_each_profile_selects_one_inference_backend() -> None:
    cpu = compose_config(("cpu",))["services"]
    gpu = compose_config(("gpu",))["services"]
    assert "inference-cpu" in cpu and "inference-gpu" not in cpu
    assert "inference-gpu" in gpu and "inference-cpu" not in gpu
    # Both answer to the name the workers call.
    for services, name in ((cpu, "inference-cpu"), (gpu, "inference-gpu")):
        assert "inference" in services[name]["networks"]["default"]["aliases"]
        assert services["worker"]["environment"]["EAGLE3_INFERENCE_URL"] == "http://inference:30000"
    monitoring = compose_config(("monitoring",))["services"]
    assert {"flower", "prometheus"} <= set(monitoring)


def test_worker_can_be_scaled(config: dict[str, Any]) -> None:
    worker = config["services"]["worker"]
    assert "container_name" not in worker, "a fixed container name makes --scale worker=N fail"
    assert "hostname" not in worker
    assert not worker.get("ports"), "a published host port makes --scale worker=N fail"
    assert worker.get("deploy", {}).get("replicas") in (None, 1)


def test_worker_stop_grace_period_exceeds_soft_shutdown(config: dict[str, Any]) -> None:
    worker = config["services"]["worker"]
    soft_shutdown_s = Settings(_env_file=ENV_EXAMPLE).soft_shutdown_timeout_s
    grace_s = _seconds(worker["stop_grace_period"])
    assert grace_s >= soft_shutdown_s + 15, f"stop_grace_period {grace_s}s vs soft shutdown {soft_shutdown_s}s"
    # SIGTERM must start the soft shutdown (re-queue), and reach Celery directly: exec form, no shell.
    assert worker["environment"]["REMAP_SIGTERM"] == "SIGQUIT"
    assert isinstance(worker["command"], list) and worker["command"][0] == "eagle3"
    assert worker.get("entrypoint") in (None, [])


def test_every_service_command_is_a_real_eagle3_subcommand(config: dict[str, Any]) -> None:
    ours = {name: s for name, s in config["services"].items() if EAGLE3_IMAGE.match(s.get("image", ""))}
    assert {"producer", "worker", "inference-cpu", "trainer", "model-init"} <= set(ours)
    for name, service in ours.items():
        parse_eagle3_command(service["command"], f"service {name} command")
        test = service.get("healthcheck", {}).get("test") or []
        if len(test) > 1 and test[1] == "eagle3":
            parse_eagle3_command(test[1:], f"service {name} healthcheck")


def test_every_eagle3_variable_is_a_setting(config: dict[str, Any]) -> None:
    seen = {key for s in config["services"].values() for key in (s.get("environment") or {})}
    unknown = {k for k in seen if k.startswith("EAGLE3_")} - SETTING_NAMES
    assert not unknown, f"compose sets variables that are not fields of shared/settings.py: {sorted(unknown)}"


def test_compose_settings_are_valid_settings(config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    ours = [s for s in config["services"].values() if EAGLE3_IMAGE.match(s.get("image", ""))]
    assert len(ours) >= 3, "the producer, worker and inference services run our image"
    for service in ours:
        with monkeypatch.context() as m:
            for key, value in (service.get("environment") or {}).items():
                if key.startswith("EAGLE3_") and value is not None:
                    m.setenv(key, value)
            Settings(_env_file=None)  # raises on a bad value


def _env_example_names() -> set[str]:
    # Active lines and commented examples ("# EAGLE3_X=..."): both document a variable.
    return set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), flags=re.MULTILINE))


def test_env_example_names_only_real_settings() -> None:
    eagle3 = {n for n in _env_example_names() if n.startswith("EAGLE3_")}
    assert not eagle3 - SETTING_NAMES, f".env.example names unknown settings: {sorted(eagle3 - SETTING_NAMES)}"


def test_env_example_documents_every_setting() -> None:
    missing = SETTING_NAMES - _env_example_names()
    assert not missing, f".env.example does not mention {sorted(missing)}"


def test_env_example_values_are_valid_settings() -> None:
    values = dotenv_values(ENV_EXAMPLE)
    assert values.get("COMPOSE_PROFILES") == "cpu"
    Settings(_env_file=ENV_EXAMPLE)  # every active EAGLE3_ line parses and passes the validators


def test_every_compose_variable_has_a_default_or_an_example() -> None:
    # A variable without a default renders as "" and silently breaks a service.
    text = COMPOSE_FILE.read_text()
    used = set(re.findall(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*)\}", text)) - {"TRAIN_JOB"}
    assert not used - _env_example_names(), f"variables with no default: {sorted(used - _env_example_names())}"


def test_worker_and_inference_share_the_handoff_tmpfs(config: dict[str, Any]) -> None:
    services = config["services"]
    shm_dir = Path(services["worker"]["environment"]["EAGLE3_SHM_DIR"])
    assert services["worker"]["environment"]["EAGLE3_CAPTURE_TRANSPORT"] == "shm"

    def handoff_mount(name: str) -> dict[str, Any]:
        mounts = [v for v in services[name]["volumes"] if v["type"] == "volume" and v["source"] == "handoff"]
        assert len(mounts) == 1, f"{name} does not mount the handoff volume"
        return mounts[0]

    for name in ("worker", "inference-cpu", "inference-gpu"):
        mount = handoff_mount(name)
        assert shm_dir.is_relative_to(mount["target"]), f"{name}: {shm_dir} is not on the handoff volume"
        assert services[name]["environment"]["EAGLE3_SHM_DIR"] == str(shm_dir)
    assert config["volumes"]["handoff"]["driver_opts"]["type"] == "tmpfs"


def test_gpu_inference_reserves_an_nvidia_gpu(config: dict[str, Any]) -> None:
    devices = config["services"]["inference-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "deploy" not in config["services"]["inference-cpu"]
    trainer_gpu = compose_config(("train",), files=(COMPOSE_FILE, TRAINER_GPU_FILE))["services"]["trainer"]
    assert trainer_gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_redis_keeps_the_queue_across_restarts(config: dict[str, Any]) -> None:
    redis = config["services"]["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--appendfsync everysec" in command
    assert "--maxmemory-policy noeviction" in command
    assert any(v["target"] == "/data" and v["type"] == "volume" for v in redis["volumes"])
    assert redis["image"].startswith("redis:7.")


def test_healthy_dependencies_have_healthchecks(config: dict[str, Any]) -> None:
    services = config["services"]
    for name, service in services.items():
        for dependency, spec in (service.get("depends_on") or {}).items():
            if spec["condition"] == "service_healthy":
                check = services[dependency].get("healthcheck") or {}
                assert check.get("test") and not check.get("disable"), f"{name} waits for {dependency}'s health"
    assert services["worker"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["producer"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["s3-init"]["depends_on"]["s3"]["condition"] == "service_healthy"
    for name in ("producer", "worker"):
        assert services[name]["depends_on"]["s3-init"]["condition"] == "service_completed_successfully"


def test_long_running_services_restart(config: dict[str, Any]) -> None:
    one_shot = {"s3-init", "model-init"}
    for name, service in config["services"].items():
        expected = {"no"} if name in one_shot else {"unless-stopped", "always", "on-failure"}
        assert service.get("restart") in expected, f"{name}: restart {service.get('restart')!r}"


def test_only_the_producer_and_monitoring_publish_ports(config: dict[str, Any]) -> None:
    published = {name for name, s in config["services"].items() if s.get("ports")}
    assert published == {"producer", "flower", "prometheus"}
    assert config["services"]["producer"]["ports"][0]["target"] == Settings().api_port


def test_images_are_pinned(config: dict[str, Any]) -> None:
    for name, service in config["services"].items():
        image = service["image"]
        if EAGLE3_IMAGE.match(image) or image.startswith("eagle3-sglang"):
            continue  # built here
        assert ":" in image and not image.endswith(":latest"), f"{name}: image {image} is not pinned"


def test_build_targets_exist_in_the_dockerfile(config: dict[str, Any]) -> None:
    _, stages = parse_dockerfile(DOCKERFILE)
    names = {s.name for s in stages}
    for name, service in config["services"].items():
        build = service.get("build")
        if not build:
            continue
        assert Path(build["context"]) == REPO, f"{name}: the build context is the repository root"
        dockerfile = REPO / build["dockerfile"]
        if name == "inference-gpu":
            # The SGLang image (the SGLang issue's Dockerfile, checked by test_images.py): one stage, no target.
            assert build["dockerfile"] == "services/inference/sglang/Dockerfile"
            assert "target" not in build
            continue
        assert dockerfile == DOCKERFILE, f"{name}: builds {dockerfile}"
        assert build["target"] in names, f"{name}: no stage {build['target']} in {DOCKERFILE}"


def test_prometheus_scrapes_the_services_metrics(config: dict[str, Any]) -> None:
    import yaml

    mount = next(v for v in config["services"]["prometheus"]["volumes"] if v["target"].endswith("prometheus.yml"))
    scrape = yaml.safe_load(Path(mount["source"]).read_text())["scrape_configs"]
    targets = {t for job in scrape for c in job["static_configs"] for t in c["targets"]}
    assert targets == {"producer:8000", "inference:30000", "flower:5555", "trainer:9400"}
    flower = config["services"]["flower"]["command"]
    assert "--broker=redis://redis:6379/0" in flower
    assert config["services"]["worker"]["environment"]["EAGLE3_REDIS_URL"] == "redis://redis:6379/0"

"""k8s/: every overlay rendered with kustomize (kubectl's) and validated strictly with kubernetes-validate; then
the checks a schema cannot make: GPU limits, shared memory, probes, KEDA's list name against the real queue."""

import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml

from shared.lifecycle.queue import SHARD_QUEUE
from shared.settings import Settings
from tests.deploy.tools import (
    EAGLE3_IMAGE,
    K8S,
    OVERLAYS,
    OVERLAYS_WITHOUT_KEDA,
    REPO,
    documented_trainer_start,
    find,
    parse_eagle3_command,
    render_kustomization,
    tool,
)

# The newest Kubernetes the validator knows, and the oldest the manifests support (native sidecars: 1.29).
K8S_VERSIONS = ("1.37.0", "1.29.0")
SETTING_NAMES = {f"EAGLE3_{name.upper()}" for name in Settings.model_fields}
KEDA_REDIS_METADATA = {
    "address",
    "addressFromEnv",
    "host",
    "hostFromEnv",
    "port",
    "portFromEnv",
    "listName",
    "listLength",
    "activationListLength",
    "databaseIndex",
    "enableTLS",
    "unsafeSsl",
    "usernameFromEnv",
    "passwordFromEnv",
}
KEDA_SPEC = {
    "scaleTargetRef",
    "pollingInterval",
    "cooldownPeriod",
    "initialCooldownPeriod",
    "idleReplicaCount",
    "minReplicaCount",
    "maxReplicaCount",
    "fallback",
    "advanced",
    "triggers",
}
# The HPA fallback component on the gpu overlay, and on cpu-small (which has no ScaledObject to delete).
HPA_FALLBACK_VARIANTS = ("gpu+hpa-fallback", "cpu-small+hpa-fallback")
VARIANTS = (*OVERLAYS, *HPA_FALLBACK_VARIANTS)
# What applies on a cluster without KEDA: no ScaledObject, no other custom resource.
VARIANTS_WITHOUT_KEDA = (*OVERLAYS_WITHOUT_KEDA, *HPA_FALLBACK_VARIANTS)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = {name: render_kustomization(K8S / "overlays" / name) for name in OVERLAYS}
    # The HPA fallback is a kustomize Component: render it on top of an overlay, as docs/deployment.md shows.
    for variant in HPA_FALLBACK_VARIANTS:
        overlay, component = variant.split("+")
        root = tmp_path_factory.mktemp(variant)
        relative = Path(os.path.relpath(K8S, root))
        (root / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": [str(relative / "overlays" / overlay)],
                    "components": [str(relative / "components" / component)],
                }
            )
        )
        out[variant] = render_kustomization(root)
    return out


def _settings_data(docs: list[dict[str, Any]]) -> dict[str, str]:
    maps = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("eagle3-settings")]
    assert len(maps) == 1
    return maps[0]["data"]


def _pod_template(doc: dict[str, Any]) -> dict[str, Any]:
    """The pod template of a workload; a CronJob's is inside its Job template."""
    spec = doc["spec"]["jobTemplate"]["spec"] if doc["kind"] == "CronJob" else doc["spec"]
    return spec["template"]


def _pod_spec(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return _pod_template(find(docs, kind, name))["spec"]


def _container(pod: dict[str, Any], name: str, *, init: bool = False) -> dict[str, Any]:
    containers = pod.get("initContainers" if init else "containers", [])
    matches = [c for c in containers if c["name"] == name]
    assert len(matches) == 1, f"no {'init ' if init else ''}container {name}"
    return matches[0]


def _workloads(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{d['kind']}/{d['metadata']['name']}", _pod_template(d)["spec"])
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet", "Job", "CronJob", "DaemonSet")
    ]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_overlay_renders_and_validates_strictly(
    rendered: dict[str, list[dict[str, Any]]], variant: str, version: str
) -> None:
    docs = rendered[variant]
    unknown_kinds = set()
    for doc in docs:
        where = f"{variant}: {doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            unknown_kinds.add(doc["kind"])  # a CRD: checked below
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where} is invalid for Kubernetes {version}: {exc.message} at {list(exc.path)}")
    assert unknown_kinds <= {"ScaledObject"}, f"no schema for {unknown_kinds}"
    if variant in VARIANTS_WITHOUT_KEDA:
        assert not unknown_kinds, f"{variant} must apply without KEDA, but renders {unknown_kinds}"
    assert all(d["metadata"].get("namespace") == "eagle3" for d in docs if d["kind"] != "Namespace")


def test_every_overlay_is_checked_here_and_by_make_k8s_validate() -> None:
    on_disk = {p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml")}
    assert set(OVERLAYS) == on_disk, "tests/deploy/tools.py OVERLAYS must list every overlay under k8s/overlays"
    makefile = (REPO / "Makefile").read_text()
    (line,) = re.findall(r"^K8S_OVERLAYS\s*:?=(.*)$", makefile, flags=re.MULTILINE)
    assert set(line.split()) == on_disk, "the Makefile's K8S_OVERLAYS must list every overlay under k8s/overlays"


def test_strict_validation_rejects_unknown_fields(rendered: dict[str, list[dict[str, Any]]]) -> None:
    worker = find(rendered["gpu"], "Deployment", "worker")
    worker["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, K8S_VERSIONS[0], strict=True)


def test_secret_template_is_valid_and_holds_no_secret() -> None:
    template = yaml.safe_load((K8S / "base" / "secret.template.yaml").read_text())
    kubernetes_validate.validate(template, K8S_VERSIONS[0], strict=True)
    for key, value in template["stringData"].items():
        assert value.startswith("<") and value.endswith(">"), f"{key}: the template holds a value, not a placeholder"
        assert not key.startswith("EAGLE3_") or key in SETTING_NAMES
    # The template must stay out of the kustomizations, or an unfilled Secret would be applied.
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert "secret.template.yaml" not in base["resources"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_eagle3_variable_is_a_valid_setting(
    rendered: dict[str, list[dict[str, Any]]], variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = rendered[variant]
    data = _settings_data(docs)
    names = set(data)
    for _, pod in _workloads(docs):
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            names |= {e["name"] for e in container.get("env", [])}
    for secret in (d for d in docs if d["kind"] == "Secret"):
        names |= set(secret.get("data", {})) | set(secret.get("stringData", {}))
    unknown = {n for n in names if n.startswith("EAGLE3_")} - SETTING_NAMES
    assert not unknown, f"{variant} sets variables that are not fields of shared/settings.py: {sorted(unknown)}"
    for key, value in data.items():
        monkeypatch.setenv(key, value)
    Settings(_env_file=None)  # the ConfigMap's values pass the settings validators


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_command_is_a_real_eagle3_subcommand(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    checked = set()
    for workload, pod in _workloads(rendered[variant]):
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            if not EAGLE3_IMAGE.match(container["image"]):
                continue
            where = f"{variant}: {workload} container {container['name']}"
            command = [c.replace("$(TRAIN_JOB)", "job-0") for c in container["command"]]
            checked.add(parse_eagle3_command(command, where).command)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                exec_command = container.get(probe, {}).get("exec", {}).get("command")
                if exec_command:
                    parse_eagle3_command(exec_command, f"{where} {probe}")
    assert {"api", "worker", "train"} <= checked


def test_redis_scaledobject_scales_workers_on_the_real_queue(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for variant in OVERLAYS:
        docs = rendered[variant]
        if variant in OVERLAYS_WITHOUT_KEDA:
            assert not [d for d in docs if d["kind"] == "ScaledObject"], f"{variant} must apply without KEDA"
            continue
        scaled = find(docs, "ScaledObject", "worker")
        assert scaled["apiVersion"] == "keda.sh/v1alpha1"
        spec = scaled["spec"]
        assert set(spec) <= KEDA_SPEC, f"unknown ScaledObject fields {set(spec) - KEDA_SPEC}"
        find(docs, "Deployment", spec["scaleTargetRef"]["name"])  # it targets a Deployment that exists
        assert spec["scaleTargetRef"]["name"] == "worker"
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]

        (trigger,) = spec["triggers"]
        assert trigger["type"] == "redis"
        metadata = trigger["metadata"]
        assert set(metadata) <= KEDA_REDIS_METADATA, f"unknown redis trigger keys {set(metadata) - KEDA_REDIS_METADATA}"
        assert all(isinstance(v, str) for v in metadata.values()), "KEDA trigger metadata values must be strings"
        assert metadata["listName"] == SHARD_QUEUE  # the list the workers consume (`eagle3 worker --queues`)
        assert int(metadata["listLength"]) >= 1
        # The same Redis and database as the workers' broker.
        broker = urlparse(_settings_data(docs)["EAGLE3_REDIS_URL"])
        assert metadata["address"] == f"{broker.hostname}:{broker.port or 6379}"
        assert broker.hostname.endswith(".svc.cluster.local"), "KEDA resolves the address from its own namespace"
        assert metadata["databaseIndex"] == (broker.path.lstrip("/") or "0")

        scale_down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert scale_down["stabilizationWindowSeconds"] >= 300


@pytest.mark.parametrize("variant", HPA_FALLBACK_VARIANTS)
def test_hpa_fallback_replaces_the_scaledobject(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    docs = rendered[variant]
    assert not [d for d in docs if d["kind"] == "ScaledObject"]
    hpa = find(docs, "HorizontalPodAutoscaler", "worker")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "worker"}
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300


@pytest.mark.parametrize("variant", OVERLAYS)
def test_worker_pod_runs_inference_as_a_native_sidecar(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    docs = rendered[variant]
    data = _settings_data(docs)
    pod = _pod_spec(docs, "Deployment", "worker")
    inference = _container(pod, "inference", init=True)
    worker = _container(pod, "worker")

    # Started before the worker, ready only once the model is loaded, stopped after the worker exits.
    assert inference["restartPolicy"] == "Always"
    assert [c["name"] for c in pod["initContainers"]][-1] == "inference", "the sidecar must be the last init container"
    port = int(data["EAGLE3_INFERENCE_PORT"])
    named_ports = {p["name"]: p["containerPort"] for p in inference["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        http = inference[probe]["httpGet"]
        assert http["path"] == "/health"
        assert named_ports.get(http["port"], http["port"]) == port, f"{probe} probes another port"
        assert inference[probe].get("timeoutSeconds", 1) > 20, "SGLang's /health can take up to 20 s"
    startup = inference["startupProbe"]
    startup_budget_s = startup["periodSeconds"] * startup["failureThreshold"]
    assert startup_budget_s >= (1800 if variant == "gpu" else 600), "too short for model loading"
    assert data["EAGLE3_INFERENCE_HOST"] == "0.0.0.0", "the kubelet probes the pod IP"
    assert urlparse(data["EAGLE3_INFERENCE_URL"]).port == port
    assert urlparse(data["EAGLE3_INFERENCE_URL"]).hostname in ("127.0.0.1", "localhost")

    # Liveness of the worker: the local heartbeat (connected but not consuming), never a broker round trip.
    for probe in ("startupProbe", "livenessProbe"):
        command = worker[probe]["exec"]["command"]
        args = parse_eagle3_command(command, f"worker {probe}")
        assert args.command == "worker-probe"
        assert args.max_age >= 4 * 15, "several heartbeat intervals (15 s)"
    assert "readinessProbe" not in worker


@pytest.mark.parametrize("variant", OVERLAYS)
def test_shared_memory_is_a_memory_emptydir_in_both_containers(
    rendered: dict[str, list[dict[str, Any]]], variant: str
) -> None:
    docs = rendered[variant]
    data = _settings_data(docs)
    pod = _pod_spec(docs, "Deployment", "worker")
    assert data["EAGLE3_CAPTURE_TRANSPORT"] == "shm"
    shm_dir = Path(data["EAGLE3_SHM_DIR"])
    volumes = {v["name"]: v for v in pod["volumes"]}
    for container in (_container(pod, "inference", init=True), _container(pod, "worker")):
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert "/dev/shm" in mounts, f"{container['name']} has no /dev/shm volume"
        volume = volumes[mounts["/dev/shm"]]
        assert volume["emptyDir"]["medium"] == "Memory"
        assert volume["emptyDir"].get("sizeLimit")
        holder = max((p for p in mounts if shm_dir.is_relative_to(p)), key=len)
        assert mounts[holder] == mounts["/dev/shm"], f"{container['name']}: {shm_dir} is not on the shared volume"


@pytest.mark.parametrize("variant", OVERLAYS)
def test_gpu_limit_is_on_the_inference_container_only(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    docs = rendered[variant]
    pod = _pod_spec(docs, "Deployment", "worker")
    inference = _container(pod, "inference", init=True)
    worker = _container(pod, "worker")
    assert "nvidia.com/gpu" not in worker.get("resources", {}).get("limits", {})
    if variant == "gpu":
        assert inference["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert inference["resources"]["requests"]["nvidia.com/gpu"] == 1  # requests must equal limits
        assert "eagle3-sglang" in inference["image"]
        assert "command" not in inference, "the SGLang image starts itself"
        assert _container(_pod_spec(docs, "CronJob", "trainer"), "trainer")["resources"]["limits"]["nvidia.com/gpu"]
    else:
        for _, any_pod in _workloads(docs):
            for c in any_pod.get("containers", []) + any_pod.get("initContainers", []):
                assert "nvidia.com/gpu" not in c.get("resources", {}).get("limits", {}), f"{c['name']} asks for a GPU"
        assert EAGLE3_IMAGE.match(inference["image"]), inference["image"]
        assert inference["command"] == ["eagle3", "inference"]


@pytest.mark.parametrize("variant", OVERLAYS)
def test_termination_grace_outlasts_soft_shutdown(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    docs = rendered[variant]
    pod = _pod_spec(docs, "Deployment", "worker")
    soft_shutdown_s = float(_settings_data(docs)["EAGLE3_SOFT_SHUTDOWN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] >= soft_shutdown_s + 60
    env = {e["name"]: e.get("value") for e in _container(pod, "worker").get("env", [])}
    assert env["REMAP_SIGTERM"] == "SIGQUIT", "SIGTERM must start Celery's soft shutdown, which re-queues"
    assert pod["terminationGracePeriodSeconds"] >= 300, "longer than a shard"


@pytest.mark.parametrize("variant", OVERLAYS)
def test_trainer_is_a_job_template_that_runs_only_when_started(
    rendered: dict[str, list[dict[str, Any]]], variant: str
) -> None:
    """The trainer runs to completion as one Job per run, made from a suspended CronJob (docs/deployment.md): nothing
    trains on `kubectl apply -k`, a replacement pod resumes the same run, and the finished Job goes away on its own."""
    docs = rendered[variant]
    assert not [d for d in docs if d["kind"] != "CronJob" and d["metadata"]["name"] == "trainer"], "one trainer object"
    cronjob = find(docs, "CronJob", "trainer")
    assert cronjob["spec"]["suspend"] is True, "the template must never start a run on its schedule"
    job = cronjob["spec"]["jobTemplate"]
    spec = job["spec"]
    # `kubectl create job --from` copies the template's labels onto the Job; the Job controller gives the pod its own.
    for labels in (job["metadata"]["labels"], spec["template"]["metadata"]["labels"]):
        assert labels["app.kubernetes.io/component"] == "trainer"
        assert labels["app.kubernetes.io/part-of"] == "eagle3-factory", "delete -k and the live test find it by label"

    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy needs it: a failed container is a failed pod
    assert 1 <= spec["backoffLimit"] <= 6, "a failed pod is retried a few times, then the Job fails"
    ignored = [r for r in spec["podFailurePolicy"]["rules"] if r["action"] == "Ignore"]
    assert [c["type"] for r in ignored for c in r.get("onPodConditions", [])] == ["DisruptionTarget"], (
        "an evicted or drained pod must not count as a failure"
    )
    assert spec["podReplacementPolicy"] == "Failed", "never two pods of one run at once"
    assert spec["ttlSecondsAfterFinished"] >= 24 * 3600, "time to read the run's summary in its log"
    assert "activeDeadlineSeconds" not in spec, "a run follows its job for as long as the job extracts"

    trainer = _container(pod, "trainer")
    args = parse_eagle3_command([c.replace("$(TRAIN_JOB)", "job-0") for c in trainer["command"]], "trainer")
    assert args.command == "train" and trainer["command"][trainer["command"].index("--job") + 1] == "$(TRAIN_JOB)"
    assert args.resume, "a replacement pod must continue from the run's latest checkpoint"
    assert args.follow, "the trainer follows the job while it extracts"
    # A plain value in the pod template, which `kubectl set env` rewrites in each Job before it is created.
    (train_job,) = [e for e in trainer["env"] if e["name"] == "TRAIN_JOB"]
    assert "valueFrom" not in train_job


def test_documented_trainer_start_writes_the_job_id_into_the_job(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The docs' pipeline, stage by stage: the first asks the cluster for a Job made from the trainer template (the
    live test runs it), the second writes the job id into that Job without a cluster (run here on the Job the
    template makes), the third creates it. The result is a valid Job whose trainer trains that job."""
    stages = [stage.strip() for stage in documented_trainer_start().split("|")]
    assert len(stages) == 3, stages
    make, set_env, create = (shlex.split(stage) for stage in stages)
    cronjob = find(rendered["cpu-small"], "CronJob", "trainer")
    assert make[:5] == ["kubectl", "-n", "eagle3", "create", "job"]
    assert {f"--from=cronjob/{cronjob['metadata']['name']}", "--dry-run=client"} <= set(make)
    assert create[:4] == ["kubectl", "-n", "eagle3", "create"]
    assert set_env[:3] == ["kubectl", "set", "env"] and "--local" in set_env

    # What `kubectl create job NAME --from=cronjob/trainer` builds (kubectl's createJobFromCronJob).
    made = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": "trainer-run-1",
            "namespace": "eagle3",
            "annotations": {"cronjob.kubernetes.io/instantiate": "manual"},
            "labels": cronjob["spec"]["jobTemplate"]["metadata"]["labels"],
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "CronJob", "name": "trainer", "uid": "0"}],
        },
        "spec": cronjob["spec"]["jobTemplate"]["spec"],
    }
    job_id = "Job_2026.12-07"  # a job id may hold what a Kubernetes name may not
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", stages[1]],
        input=yaml.safe_dump(made),
        env={**os.environ, "PATH": f"{tool('kubectl').parent}:{os.environ.get('PATH', '')}", "TRAIN_JOB": job_id},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    job = yaml.safe_load(result.stdout)
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)
    trainer = _container(job["spec"]["template"]["spec"], "trainer")
    assert {"name": "TRAIN_JOB", "value": job_id} in trainer["env"]
    assert job["metadata"]["ownerReferences"] == made["metadata"]["ownerReferences"], "delete -k must reach the Job"
    unchanged = dict(job["spec"], template={**job["spec"]["template"], "spec": {}})
    assert unchanged == dict(made["spec"], template={**made["spec"]["template"], "spec": {}})


def test_pdb_covers_the_worker_pods(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for variant in OVERLAYS:
        docs = rendered[variant]
        pdb = find(docs, "PodDisruptionBudget", "worker")
        labels = find(docs, "Deployment", "worker")["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert pdb["spec"].get("maxUnavailable") == 1


@pytest.mark.parametrize("variant", OVERLAYS)
def test_redis_is_a_statefulset_with_aof_on_a_volume(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    docs = rendered[variant]
    redis = find(docs, "StatefulSet", "redis")
    container = _container(redis["spec"]["template"]["spec"], "redis")
    args = " ".join(container["args"])
    assert "--appendonly yes" in args and "--appendfsync everysec" in args and "--maxmemory-policy noeviction" in args
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in container["volumeMounts"]
    service = find(docs, "Service", "redis")
    assert urlparse(_settings_data(docs)["EAGLE3_REDIS_URL"]).hostname.startswith(f"{service['metadata']['name']}.")


@pytest.mark.parametrize("variant", OVERLAYS)
def test_producer_service_reaches_the_api_port(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    docs = rendered[variant]
    data = _settings_data(docs)
    service = find(docs, "Service", "producer")
    producer = _container(_pod_spec(docs, "Deployment", "producer"), "producer")
    named = {p["name"]: p["containerPort"] for p in producer["ports"]}
    (port,) = service["spec"]["ports"]
    assert named[port["targetPort"]] == int(data["EAGLE3_API_PORT"]) == port["port"]
    assert data["EAGLE3_API_HOST"] == "0.0.0.0"
    assert urlparse(data["EAGLE3_API_URL"]).hostname.startswith("producer.")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert producer[probe]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("variant", OVERLAYS)
def test_pods_run_as_non_root_and_mount_what_they_declare(
    rendered: dict[str, list[dict[str, Any]]], variant: str
) -> None:
    docs = rendered[variant]
    config_maps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    for workload, pod in _workloads(docs):
        volumes = {v["name"] for v in pod.get("volumes", [])}
        templates = {
            t["metadata"]["name"] for d in docs if d["kind"] == "StatefulSet" for t in d["spec"]["volumeClaimTemplates"]
        }
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            where = f"{variant}: {workload} container {container['name']}"
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes | templates, f"{where} mounts undeclared volume {mount['name']}"
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in config_maps, f"{where}: no ConfigMap"
                if "secretRef" in source:
                    ref = source["secretRef"]
                    assert ref.get("optional") or ref["name"] in secrets, f"{where}: Secret {ref['name']} missing"
            if EAGLE3_IMAGE.match(container["image"]) or "eagle3-sglang" in container["image"]:
                context = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
                assert context.get("runAsNonRoot") is True, f"{where} may run as root"
                assert context.get("runAsUser", 0) != 0
                assert context.get("allowPrivilegeEscalation") is False

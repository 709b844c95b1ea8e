"""The live-cluster test runs only where the single-node cluster tool and a Docker daemon are on the machine
(CI's machines have both beside the clone); elsewhere it is skipped with the reason. Its timings print at the end."""

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests.compose.conftest import docker_unavailable_reason
from tests.fixtures import step_timings

REPO = Path(__file__).resolve().parents[2]
# The tool that starts a real single-node Kubernetes cluster on this kind of machine; another path with
# EAGLE3_K8S_CLUSTER_TOOL.
CLUSTER_TOOL = Path(
    os.environ.get("EAGLE3_K8S_CLUSTER_TOOL", REPO.parent / "shared" / "tools" / "k8s-cluster" / "k8s-cluster.sh")
)
# The tool's own containerd socket and the API server's port: the tool runs one cluster per machine.
CLUSTER_CONTAINERD = Path("/run/k8s-containerd/containerd.sock")
API_SERVER_PORT = 6443

# Filled by the test: what each step on the live cluster took, printed in the terminal summary.
TIMINGS_S = step_timings.table("Kubernetes on a live single-node cluster: seconds per step")


def cluster_unavailable_reason() -> str | None:
    """Why the live-cluster test cannot run here, or None when it can start its own cluster."""
    if not CLUSTER_TOOL.is_file():
        return f"no cluster tool at {CLUSTER_TOOL} (set EAGLE3_K8S_CLUSTER_TOOL to a k8s-cluster.sh)"
    if os.geteuid() != 0:
        return "the cluster tool runs containerd, the kubelet and kube-proxy, which need root"
    if shutil.which("bash") is None:
        return "no bash"
    # The test starts a fresh cluster of its own (fresh etcd and volumes), so none may run already. Both checks
    # stay on this machine: a unix socket, and the kernel's table of listening sockets.
    with socket.socket(socket.AF_UNIX) as probe:
        if CLUSTER_CONTAINERD.exists() and probe.connect_ex(str(CLUSTER_CONTAINERD)) == 0:
            return f"the cluster tool's containerd already answers on {CLUSTER_CONTAINERD}: stop that cluster first"
    listening = subprocess.run(
        ["ss", "-ltnH", f"sport = :{API_SERVER_PORT}"], capture_output=True, text=True, timeout=20
    ).stdout
    if listening.strip():
        return f"something already listens on port {API_SERVER_PORT} (a Kubernetes API server?): stop it first"
    return docker_unavailable_reason()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "k8s: applies k8s/ to a real single-node Kubernetes cluster")
    # The module imports the compose test's checks, and with them its marker, when tests/compose is not collected.
    config.addinivalue_line("markers", "compose: builds the images and runs docker-compose.yml on a real Docker engine")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if item.get_closest_marker("k8s")]
    if not ours:
        return
    reason = cluster_unavailable_reason()
    if reason is not None:
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=reason))

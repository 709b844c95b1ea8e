"""Container HEALTHCHECK for the eagle3 images: standard library only, so it costs ~30 ms, not an import of torch.

    python healthcheck.py api        GET http://127.0.0.1:$EAGLE3_API_PORT/health        (default 8000)
    python healthcheck.py inference  GET http://127.0.0.1:$EAGLE3_INFERENCE_PORT/health  (default 30000)
    python healthcheck.py redis      PING the Redis at $EAGLE3_REDIS_URL
    python healthcheck.py worker     the worker's heartbeat file ($EAGLE3_WORKER_HEARTBEAT_FILE) is at most 120 s
                                     old: what `eagle3 worker-probe` checks (services/worker/heartbeat.py), without
                                     the seconds the eagle3 CLI takes to import on a busy machine
    python healthcheck.py auto       the check of the eagle3 command running as PID 1 (the image's HEALTHCHECK):
                                     api, inference, worker as above; train: redis; any other command
                                     (prepare-model, a one-shot) has no check and passes

Exit 0 when healthy, 1 with the reason otherwise (Docker keeps the output in `docker inspect`).
"""

import os
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

TIMEOUT_S = 5.0
WORKER_HEARTBEAT_FILE = "/tmp/eagle3-worker-heartbeat"  # Settings.worker_heartbeat_file's default
WORKER_MAX_AGE_S = 120.0


def http_ok(port_variable: str, default_port: int) -> str | None:
    url = f"http://127.0.0.1:{os.environ.get(port_variable, default_port)}/health"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return None if response.status == 200 else f"{url}: HTTP {response.status}"
    except (urllib.error.URLError, OSError) as exc:
        return f"{url}: {exc}"


def redis_ok() -> str | None:
    url = urlparse(os.environ.get("EAGLE3_REDIS_URL", "redis://127.0.0.1:6379/0"))
    try:
        with socket.create_connection((url.hostname or "127.0.0.1", url.port or 6379), timeout=TIMEOUT_S) as sock:
            if url.scheme == "rediss":
                return None  # TLS: a TCP connect is as far as a standard-library check goes
            if url.password:
                user = url.username or "default"
                sock.sendall(f"AUTH {user} {url.password}\r\n".encode())
                sock.recv(64)
            sock.sendall(b"PING\r\n")
            answer = sock.recv(64)
    except OSError as exc:
        return f"redis {url.hostname}:{url.port}: {exc}"
    return None if answer.startswith(b"+PONG") else f"redis {url.hostname}:{url.port}: answered {answer!r}"


def worker_ok() -> str | None:
    path = os.environ.get("EAGLE3_WORKER_HEARTBEAT_FILE", WORKER_HEARTBEAT_FILE)
    try:
        age_s = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return f"worker heartbeat {path} does not exist (worker not ready yet, or it never consumed)"
    if age_s > WORKER_MAX_AGE_S:
        return f"worker heartbeat {path} is {age_s:.0f}s old (max {WORKER_MAX_AGE_S:.0f}s): the worker is not consuming"
    return None


def running_command(cmdline: bytes) -> str | None:
    """The eagle3 subcommand in a /proc/<pid>/cmdline, e.g. `python /opt/venv/bin/eagle3 worker` -> "worker"."""
    argv = [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]
    for i, arg in enumerate(argv[:-1]):
        if os.path.basename(arg) == "eagle3":
            return argv[i + 1]
    return None


def auto_ok() -> str | None:
    try:
        command = running_command(Path("/proc/1/cmdline").read_bytes())
    except OSError as exc:
        return f"cannot read the container's command: {exc}"
    checks = {
        "api": lambda: http_ok("EAGLE3_API_PORT", 8000),
        "inference": lambda: http_ok("EAGLE3_INFERENCE_PORT", 30000),
        "worker": worker_ok,
        "train": redis_ok,
    }
    return checks[command]() if command in checks else None


def main(argv: list[str]) -> int:
    checks = {
        "api": lambda: http_ok("EAGLE3_API_PORT", 8000),
        "inference": lambda: http_ok("EAGLE3_INFERENCE_PORT", 30000),
        "redis": redis_ok,
        "worker": worker_ok,
        "auto": auto_ok,
    }
    if len(argv) != 1 or argv[0] not in checks:
        print(f"usage: healthcheck.py {{{','.join(checks)}}}", file=sys.stderr)
        return 2
    reason = checks[argv[0]]()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The whole stack as local processes: Redis (reused if reachable), the reference inference server,
N Celery workers and the producer API. Stops everything it started, in reverse order, on exit."""

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from urllib.parse import urlparse

import httpx
import redis

from shared.errors import Eagle3Error
from shared.settings import Settings

logger = logging.getLogger(__name__)


class StackError(Eagle3Error):
    """A process of the local stack did not start."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis_alive(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class LocalStack:
    def __init__(
        self,
        settings: Settings,
        *,
        workers: int = 2,
        log_dir: Path,
        pick_free_ports: bool = False,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.workers = workers
        self.log_dir = log_dir
        self.pick_free_ports = pick_free_ports
        self.extra_env = extra_env or {}
        self.processes: list[tuple[str, subprocess.Popen]] = []
        self.env: dict[str, str] = {}

    def __enter__(self) -> "LocalStack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def api_url(self) -> str:
        return self.env["EAGLE3_API_URL"]

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        s = self.settings
        inference_port = free_port() if self.pick_free_ports else s.inference_port
        api_port = free_port() if self.pick_free_ports else s.api_port
        # Every process sees exactly these settings, whatever the caller's environment says.
        exported = {
            f"EAGLE3_{name.upper()}": value if isinstance(value, str) else json.dumps(value)
            for name, value in s.model_dump(mode="json").items()
            if value is not None
        }
        self.env = {
            **os.environ,
            **exported,
            **self.extra_env,
            "EAGLE3_REDIS_URL": self._ensure_redis(),
            "EAGLE3_INFERENCE_PORT": str(inference_port),
            "EAGLE3_INFERENCE_URL": f"http://127.0.0.1:{inference_port}",
            "EAGLE3_API_PORT": str(api_port),
            "EAGLE3_API_URL": f"http://127.0.0.1:{api_port}",
        }
        self.start_inference()
        for _ in range(self.workers):
            self.add_worker()
        self._spawn("producer", [sys.executable, "-m", "services.producer"])
        self._wait("producer", lambda: _http_ok(f"{self.api_url}/health"), timeout_s=60)
        logger.info(
            "local stack up: api=%s inference=%s workers=%d logs=%s",
            self.api_url,
            self.env["EAGLE3_INFERENCE_URL"],
            self.workers,
            self.log_dir,
        )

    def start_inference(self) -> None:
        self._spawn("inference", [sys.executable, "-m", "services.inference.reference"])
        self._wait("inference", lambda: _http_ok(f"{self.env['EAGLE3_INFERENCE_URL']}/health"), timeout_s=300)

    def add_worker(self) -> str:
        name = f"worker-{sum(n.startswith('worker-') for n, _ in self.processes) + 1}"
        self._spawn(name, [sys.executable, "-m", "eagle3", "worker", "--name", f"{name}@%h"])
        return name

    def _ensure_redis(self) -> str:
        url = self.settings.redis_url
        if _redis_alive(url):
            return url
        parsed = urlparse(url)
        if parsed.hostname not in ("127.0.0.1", "localhost"):
            raise StackError(f"Redis at {url} is not reachable, and it is not local, so it cannot be started here")
        port = parsed.port or 6379
        data_dir = self.log_dir / "redis"
        data_dir.mkdir(parents=True, exist_ok=True)
        self._spawn(
            "redis",
            [
                "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(data_dir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--maxmemory-policy",
                "noeviction",
            ],
        )
        self._wait("redis", lambda: _redis_alive(url), timeout_s=20)
        return url

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.log_dir / f"{name}.log").open("ab")
        # A session of its own: Ctrl-C reaches only us, and we stop the children in order.
        process = subprocess.Popen(
            argv, env=self.env or None, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.processes.append((name, process))

    def _wait(self, name: str, ready: Callable[[], bool], *, timeout_s: float) -> None:
        process = dict(self.processes)[name]
        deadline = time.monotonic() + timeout_s
        while not ready():
            if process.poll() is not None:
                raise StackError(f"{name} exited with code {process.returncode}; see {self.log_dir / (name + '.log')}")
            if time.monotonic() > deadline:
                raise StackError(f"{name} not ready after {timeout_s:.0f}s; see {self.log_dir / (name + '.log')}")
            time.sleep(0.2)

    def check_alive(self) -> None:
        for name, process in self.processes:
            if process.poll() is not None:
                raise StackError(f"{name} exited with code {process.returncode}; see {self.log_dir / (name + '.log')}")

    def stop(self, timeout_s: float | None = None) -> None:
        # Longer than the workers' soft shutdown, so unfinished shards are re-queued rather than waited for.
        timeout_s = timeout_s if timeout_s is not None else self.settings.soft_shutdown_timeout_s + 15
        for _, process in reversed(self.processes):
            _signal_group(process, signal.SIGTERM)  # the group: Celery's pool children too
        deadline = time.monotonic() + timeout_s
        for name, process in reversed(self.processes):
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0fs; killing it", name, timeout_s)
                _signal_group(process, signal.SIGKILL)
                process.wait()
        self.processes.clear()


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)

"""The whole stack as local processes: Redis (reused if reachable), the inference server (the reference one, or
SGLang with the capture plugin for the GPU demo), N Celery workers and the producer API. Stops everything it
started, in reverse order, on exit.

`supervise()` is a restart policy like compose's `restart: unless-stopped`: a process that exits is started again
with the same command and log file, after a back-off that doubles with each quick death (1 s up to 30 s) and resets
once the process has stayed up for a minute; the others go on meanwhile."""

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
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import urlparse

import httpx
import redis

from shared import access, urls
from shared.errors import Eagle3Error
from shared.settings import Settings

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = (1.0, 30.0)  # first and longest wait before starting a dead process again
STABLE_AFTER_S = 60.0  # a process up this long has recovered: its next death waits the shortest back-off again


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
        inference_argv: list[str] | None = None,
        inference_ready_timeout_s: float = 300.0,
    ) -> None:
        self.settings = settings
        # The reference server by default; the GPU demo runs SGLang with the capture plugin instead.
        self.inference_argv = inference_argv or [sys.executable, "-m", "services.inference.reference"]
        self.inference_ready_timeout_s = inference_ready_timeout_s
        self.workers = workers
        self.log_dir = log_dir
        self.pick_free_ports = pick_free_ports
        self.extra_env = extra_env or {}
        self.processes: list[tuple[str, subprocess.Popen]] = []
        self.commands: dict[str, list[str]] = {}
        self.restarts: dict[str, _Restarts] = {}
        self.env: dict[str, str] = {}
        # The API is closed like any other: the configured token, else one for this session.
        self.api_token: str | None = None
        if settings.api_auth == "on":
            self.api_token = settings.api_token.get_secret_value() if settings.api_token else access.new_api_token()

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

    def api_client(self, timeout_s: float = 600) -> httpx.Client:
        """An HTTP client of this stack's API, with its token."""
        headers = {"Authorization": f"Bearer {self.api_token}"} if self.api_token else {}
        return httpx.Client(base_url=self.api_url, headers=headers, timeout=timeout_s)

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        s = self.settings
        inference_port = free_port() if self.pick_free_ports else s.inference_port
        api_port = free_port() if self.pick_free_ports else s.api_port
        # Every process sees exactly these settings, whatever the caller's environment says.
        exported = {
            f"EAGLE3_{name.upper()}": value if isinstance(value, str) else json.dumps(value)
            for name, value in s.model_dump(mode="json", exclude={"api_token"}).items()
            if value is not None
        }
        self.env = {
            **os.environ,
            **exported,
            **self.extra_env,
            **({"EAGLE3_API_TOKEN": self.api_token} if self.api_token else {}),
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
        self._spawn("inference", self.inference_argv)
        self._wait(
            "inference",
            lambda: _http_ok(f"{self.env['EAGLE3_INFERENCE_URL']}/health"),
            timeout_s=self.inference_ready_timeout_s,
        )

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
            raise StackError(
                f"Redis at {urls.redact_url(url)} is not reachable, and it is not local, so it cannot be started here"
            )
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
        self.commands[name] = argv
        self.processes.append((name, self._popen(name, argv)))

    def _popen(self, name: str, argv: list[str]) -> subprocess.Popen:
        with (self.log_dir / f"{name}.log").open("ab") as log:
            # A session of its own: Ctrl-C reaches only us, and we stop the children in order.
            return subprocess.Popen(
                argv, env=self.env or None, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def supervise(self) -> list[str]:
        """Restart every process that exited once its back-off has passed; returns what happened, one line each
        (also logged). Call it periodically; a process being waited for is not restarted twice."""
        now = time.monotonic()
        lines = []
        for position, (name, process) in enumerate(self.processes):
            state = self.restarts.setdefault(name, _Restarts(started_at=now))
            if process.poll() is None:
                if state.failures and now - state.started_at >= STABLE_AFTER_S:
                    state.failures = 0
                continue
            if state.restart_at is None:
                state.restart_at = now + state.backoff_s()
                state.failures += 1
                lines.append(
                    f"{name} exited with code {process.returncode}; restarting it in {state.restart_at - now:.0f}s "
                    f"(restart {state.failures}), the rest go on; see {self.log_dir / (name + '.log')}"
                )
            elif now >= state.restart_at:
                # _popen appends to the same log, so the dead process's last lines stay above the new ones.
                self.processes[position] = (name, self._popen(name, self.commands[name]))
                state.restart_at, state.started_at = None, now
                lines.append(f"{name} restarted (pid {self.processes[position][1].pid})")
        for line in lines:
            logger.warning("%s", line)
        return lines

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


@dataclass
class _Restarts:
    """One supervised process's restart history."""

    started_at: float
    failures: int = 0  # deaths since it last stayed up STABLE_AFTER_S
    restart_at: float | None = None  # set while it waits out its back-off

    def backoff_s(self) -> float:
        first, longest = RESTART_BACKOFF_S
        return min(first * 2**self.failures, longest)


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)

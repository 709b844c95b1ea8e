"""Worker liveness: a heartbeat file that goes stale when the worker is connected but no longer consuming.

`celery inspect ping` is the wrong liveness check for a Celery worker. It goes through the broker, so a Redis
outage fails it on every pod at once, and restarts cannot fix an outage. Worse, it still answers when the task
consumer is dead: after a Redis restart a worker can reconnect and never fetch again (celery#8091, #9054,
#10205), which is exactly the failure a liveness probe should catch. So the worker touches a local file instead:

- when a task starts or finishes (`task_prerun` / `task_postrun`, in the pool process) and when the worker is
  ready (`worker_ready`);
- every `interval_s` from the consumer's event loop (the `ConsumingHeartbeat` bootstep), but only while the
  worker demonstrably consumes: every pool slot is busy, or nothing waits in the queues it consumes. A free slot
  next to a waiting message means the consumer stopped fetching, so the file ages; a blocked event loop never
  runs the timer, so the file ages too.

If Redis cannot be reached, the beat still touches the file: Celery's own reconnect loop handles an outage
(and exits after `broker_connection_max_retries`), and restarting every worker would not help.

`eagle3 worker-probe --max-age S` (the container liveness probe) fails when the file is older than S seconds.

The file defaults to /tmp/eagle3-worker-heartbeat (env EAGLE3_WORKER_HEARTBEAT_FILE) and the beat to every
15 s (env EAGLE3_WORKER_HEARTBEAT_INTERVAL_S); the probe's max age must be several beats.
"""

import logging
import time
from pathlib import Path
from typing import Any

import redis
from celery import bootsteps, signals
from celery.worker import state as worker_state

from shared.settings import get_settings

logger = logging.getLogger(__name__)

DEFAULT_MAX_AGE_S = 120.0
_REDIS_TIMEOUT_S = 2.0  # the beat runs on the consumer's event loop: never block it for long


def heartbeat_file() -> Path:
    return get_settings().worker_heartbeat_file


def heartbeat_interval_s() -> float:
    return get_settings().worker_heartbeat_interval_s


def touch(path: Path | None = None) -> None:
    """Set the heartbeat file's mtime to now; a failure is logged, never raised into Celery."""
    path = heartbeat_file() if path is None else path
    try:
        path.touch()
    except OSError as exc:
        logger.warning("cannot touch worker heartbeat %s: %s", path, exc)


def stale_reason(path: Path, max_age_s: float, *, now: float | None = None) -> str | None:
    """Why the heartbeat at `path` fails a liveness check, or None when it is fresh."""
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return f"worker heartbeat {path} does not exist (worker not ready yet, or it never consumed)"
    age_s = (time.time() if now is None else now) - mtime
    if age_s > max_age_s:
        return f"worker heartbeat {path} is {age_s:.0f}s old (max {max_age_s:.0f}s): the worker is not consuming"
    return None


class ConsumingHeartbeat(bootsteps.StartStopStep):
    """Consumer bootstep: touch the heartbeat every interval while the worker is busy or its queues are empty."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.path = heartbeat_file()
        self.interval_s = heartbeat_interval_s()
        # The queues selected at start (-Q). Read once: a cancelled consumer deselects its queue, and a
        # heartbeat that then stopped looking at that queue would call the worker healthy.
        self.queue_names = sorted(c.app.amqp.queues.consume_from)
        self.broker_url = str(c.app.conf.broker_url or "")
        self.redis_client: redis.Redis | None = None
        self.timer_entry: Any = None
        self.stalled_since: float | None = None
        self.warned = False

    def start(self, c: Any) -> None:
        if self.broker_url.startswith(("redis://", "rediss://", "unix://")):
            self.redis_client = redis.Redis.from_url(
                self.broker_url, socket_timeout=_REDIS_TIMEOUT_S, socket_connect_timeout=_REDIS_TIMEOUT_S
            )
        touch(self.path)
        self.timer_entry = c.timer.call_repeatedly(self.interval_s, self.beat, (c,), priority=10)

    def stop(self, c: Any) -> None:
        if self.timer_entry is not None:
            self.timer_entry.cancel()
            self.timer_entry = None
        if self.redis_client is not None:
            self.redis_client.close()
            self.redis_client = None

    shutdown = stop

    def beat(self, c: Any) -> None:
        if self.consuming(c):
            self.stalled_since, self.warned = None, False
            touch(self.path)

    def consuming(self, c: Any) -> bool:
        slots = getattr(c.pool, "num_processes", None) or c.controller.concurrency
        busy = len(set(worker_state.reserved_requests) | set(worker_state.active_requests))
        if busy >= slots or self.redis_client is None:
            return True
        try:
            waiting = sum(self.redis_client.llen(name) for name in self.queue_names)
        except redis.RedisError as exc:
            logger.warning("worker heartbeat: cannot read the queue length (%s); Celery's reconnect handles it", exc)
            return True
        if waiting == 0:
            return True
        # Messages wait and a slot is free. For one beat that is a fetch in flight; for longer, a stuck consumer.
        now = time.monotonic()
        if self.stalled_since is None:
            self.stalled_since = now
        elif not self.warned and now - self.stalled_since >= 2 * self.interval_s:
            self.warned = True  # once per stall: the probe, not the log, acts on it
            logger.warning(
                "heartbeat withheld: %d message(s) wait in %s, %d of %d slots free for %.0fs: not consuming?",
                waiting,
                ",".join(self.queue_names),
                slots - busy,
                slots,
                now - self.stalled_since,
            )
        return False


@signals.worker_ready.connect
def _on_worker_ready(**kwargs: Any) -> None:
    touch()


@signals.task_prerun.connect
def _on_task_prerun(**kwargs: Any) -> None:
    touch()


@signals.task_postrun.connect
def _on_task_postrun(**kwargs: Any) -> None:
    touch()

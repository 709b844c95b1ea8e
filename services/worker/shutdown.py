"""A worker told to stop exits even when its broker has gone silent.

Celery's warm and soft shutdowns run on the consumer's event loop, and a broker that stops answering without closing
the connection (its node gone, a network partition, its Kubernetes Service deleted before the worker's pod) can wedge
that loop: Celery's worker-heartbeat event retries its publish for as long as the broker is away, so a SIGTERM waited
out the pod's whole grace period (7 minutes, seen on the live-cluster test's `kubectl delete -k`).

Once a shutdown has begun, a watchdog thread pings the broker. When it has not answered for `redis_outage_wait_s`,
nothing the shutdown would still do can reach it (hand back leases, re-queue unacknowledged messages, leave the worker
registry), so the process exits: the lease reaper re-queues whatever this worker held, as after any lost worker. A
broker that answers leaves the shutdown to Celery, however long its soft shutdown takes.
"""

import logging
import os
import threading
import time
from typing import Any

import redis

from shared.settings import get_settings
from shared.urls import redact_url

logger = logging.getLogger(__name__)

PING_INTERVAL_S = 2.0
_PING_TIMEOUT_S = 2.0
EXIT_BROKER_SILENT = 75  # EX_TEMPFAIL: stopped without the broker; the shards it held come back through their leases


def broker_answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_timeout=_PING_TIMEOUT_S, socket_connect_timeout=_PING_TIMEOUT_S)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


def watch_broker(url: str, silent_exit_s: float, *, interval_s: float = PING_INTERVAL_S) -> None:
    """Exit the process once the broker has not answered for `silent_exit_s`; return never otherwise."""
    silent_since: float | None = None
    while True:
        time.sleep(interval_s)
        if broker_answers(url):
            silent_since = None
            continue
        now = time.monotonic()
        silent_since = now if silent_since is None else silent_since
        if now - silent_since >= silent_exit_s:
            logger.error(
                "stopping without the broker: %s has not answered for %.0f s of the shutdown; the shards this worker "
                "held go back to the queue when their leases lapse",
                redact_url(url),
                now - silent_since,
            )
            logging.shutdown()
            os._exit(EXIT_BROKER_SILENT)


_started = threading.Event()


def start_broker_watchdog(sender: Any = None, **_: Any) -> None:
    """Receiver of Celery's `worker_shutting_down`, sent by its SIGTERM/SIGQUIT/SIGINT handler in the main process
    (once per signal: one watchdog for them all)."""
    if _started.is_set():
        return
    _started.set()
    settings = get_settings()
    threading.Thread(
        target=watch_broker,
        args=(settings.redis_url, settings.redis_outage_wait_s),
        name="broker-watchdog",
        daemon=True,
    ).start()

"""The Celery app, configured once from the settings with the delivery semantics of docs/architecture.md."""

from urllib.parse import urlparse

from celery import Celery
from celery.signals import worker_shutting_down

from services.worker import broker, shutdown
from shared.lifecycle.queue import SHARD_QUEUE
from shared.settings import get_settings

BROKER_SOCKET_TIMEOUT_S = 10.0

settings = get_settings()
app = Celery("eagle3", broker=settings.redis_url, include=["services.worker.tasks"])
transport_options = {
    "visibility_timeout": settings.visibility_timeout_s,
    # How soon after the visibility timeout a dead worker's unacked shard is queued again (kombu's default
    # sweep is about 100 s; one cheap Redis query per interval).
    "unacked_restore_interval": settings.redelivery_sweep_s,
    "unacked_restore_throttle": 1,
    # A broker that stops answering (its node gone, a partition, its Service deleted) must not hold a read forever:
    # the event loop blocks in it, and a SIGTERM then waits for the pod's grace period (seen: 7 minutes). The
    # consuming BRPOP waits 1 s server-side, well inside these.
    "socket_timeout": BROKER_SOCKET_TIMEOUT_S,
    "socket_connect_timeout": BROKER_SOCKET_TIMEOUT_S,
    "socket_keepalive": True,
}
app.conf.update(
    task_acks_late=True,  # a shard is acknowledged only after its manifest is committed
    task_reject_on_worker_lost=True,  # a killed child puts its shard back instead of acking it
    worker_prefetch_multiplier=1,
    broker_transport_options=transport_options,
    result_backend_transport_options=transport_options,
    visibility_timeout=settings.visibility_timeout_s,
    task_ignore_result=True,  # manifests in storage are the results
    task_default_queue=SHARD_QUEUE,
    # SIGTERM (REMAP_SIGTERM=SIGQUIT in the images) with a shard running: wait this long, then cancel it and put
    # it back on the queue. Celery sleeps the whole timeout even if the shard ends sooner. An idle worker skips
    # the wait and exits at once: closing its broker channel re-queues whatever it held unacknowledged (a
    # prefetched shard, a retry waiting for its countdown), which tests/deploy/test_worker_shutdown.py checks.
    worker_soft_shutdown_timeout=settings.soft_shutdown_timeout_s,
    worker_enable_soft_shutdown_on_idle=False,
    worker_send_task_events=True,
    task_send_sent_event=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
if urlparse(settings.redis_url).scheme in broker.SCHEMES:
    app.conf.broker_transport = broker.TRANSPORT  # survives a lost connection while holding messages: see broker.py

worker_shutting_down.connect(shutdown.start_broker_watchdog)  # a silent broker cannot hold a shutdown: see shutdown.py
app.steps["consumer"].add("services.worker.heartbeat:ConsumingHeartbeat")  # liveness file: see heartbeat.py
app.steps["consumer"].add("services.worker.presence:WorkerPresence")  # worker registry and shard metrics
app.steps["consumer"].add("services.worker.leasing:LeaseKeeper")  # shard leases and their reaper: see leasing.py

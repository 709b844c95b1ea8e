"""Shard leases in the worker (the logic is shared/lifecycle/leases.py): taken when a shard message is received,
renewed by the worker's main process while it holds the message, released when the message is acknowledged or returned.

Everything runs in the main process, which is the one that holds the broker message:

- `LeasedRequest` (the shard tasks' request class) releases the lease when the message is acknowledged or
  rejected and the shard's fate is settled. A pool child killed mid-shard makes Celery return the message to the
  queue (`task_reject_on_worker_lost`): the lease goes with it, so the reaper does not run the shard a second time;
  that requeue counts as a re-run. A run that ended unsettled (it failed, its retry could not be sent to a Redis
  that is down, its acknowledgement was lost) hands its lease back to the reaper instead, which looks in storage.
- `on_task_received` takes the lease as soon as the message is reserved, countdown (retry) messages included.
- When the broker connection is lost, Celery drops the messages it holds but has not started; their leases are
  handed back to the reaper, which returns them to the queue (else they would wait out the visibility timeout).
- `LeaseKeeper`, a consumer bootstep, renews this worker's leases every `shard_lease_s / 4` and reaps expired leases
  every `lease_reaper_interval_s`: the unacknowledged message of a dead worker goes back to the front of the queue
  (kombu's own restore, as at the visibility timeout, only sooner), or, if the broker lost it, a new one is sent.
  The same reaper returns a message the broker holds as delivered a lease period ago whose shard has no lease at
  all (Redis killed between the delivery and its lease, or restarted without the lease's last write).

A worker killed whole stops renewing, so its shards run again `shard_lease_s` plus at most one reaper interval
after its last renewal: 75 s by default.

The reaper also runs the recovery checks of shared/lifecycle/recovery.py: Redis that lost its state (its jobs are
registered and published again from storage), a job whose producer died while enqueueing its shards (the rest is
enqueued), and a job left with a shard whose message the broker lost in flight (it is sent again).
"""

import contextlib
import logging
import os
import secrets
import socket
from typing import Any

import redis
from billiard.einfo import ExceptionWithTraceback
from celery import bootsteps, signals
from celery.exceptions import Retry
from celery.worker import state
from celery.worker.request import Request

from shared.errors import JobNotFound
from shared.lifecycle import leases, recovery
from shared.lifecycle.queue import Delivery, ShardSender
from shared.settings import get_settings
from shared.storage.objects import Storage, open_storage

logger = logging.getLogger(__name__)

# A job whose shards no worker leases and that has committed nothing for this many lease periods is looked at for
# shards the broker lost in flight (shared/lifecycle/recovery.py): long enough that a retry waiting out its countdown
# is in the broker by then, short enough that such a job ends within minutes.
LOST_SHARD_QUIET_LEASES = 2
_REDIS_TIMEOUT_S = 2.0  # the keeper runs on the consumer's event loop: never block it for long
_keeper: "LeaseKeeper | None" = None


class LeasedRequest(Request):
    """A shard task's request: its lease ends with its message.

    The lease is released when the shard's fate is settled: the run succeeded (committed, or found committed or
    cancelled), its retry was sent, or its message went back to the queue. Otherwise (the run failed, or its retry
    could not be sent to a Redis that is down) the lease is handed back: it expires now and the next reaper sends the
    shard again unless storage holds its manifest or dead letter. A failed shard's dead letter is normally there;
    when it could not be written, this keeps the shard from vanishing with its acknowledged message. (The lease is
    ended before Celery's deferred acknowledgement: with Redis down both fail, and the unrenewed lease expires.)"""

    settled = True  # a run that returned has its outcome: committed, found committed, or cancelled

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        # (Celery's generated request class overrides on_success, not this.) A retry's message carries the shard,
        # and its delivery takes the lease; any other failure is settled only by what storage holds.
        # A job that no longer exists (deleted while the message waited) is settled too: nothing will ever run it.
        exc = exc_info.exception
        self.settled = isinstance(exc.exc if isinstance(exc, ExceptionWithTraceback) else exc, (Retry, JobNotFound))
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def acknowledge(self) -> None:
        super().acknowledge()
        if _keeper is not None:
            _keeper.finish(self, settled=self.settled, requeued=False)

    def reject(self, requeue: bool = False) -> None:
        super().reject(requeue=requeue)
        if _keeper is not None:
            _keeper.finish(self, settled=requeue, requeued=requeue)


@signals.task_received.connect
def on_task_received(request: Request, **kwargs: Any) -> None:
    if _keeper is not None and isinstance(request, LeasedRequest):
        _keeper.acquire(request)


class LeaseKeeper(bootsteps.StartStopStep):
    """Consumer bootstep: this worker's leases (acquire, renew, release) and the reaper of everyone's."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        settings = get_settings()
        self.app = c.app
        self.lease_s = settings.shard_lease_s
        self.reaper_interval_s = settings.lease_reaper_interval_s
        self.storage_url = settings.storage_url
        self.settings = settings
        # Unique per process start: a restarted container can have the same host name and pid.
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.client: redis.Redis | None = None
        self.storage: Storage | None = None
        self.sender: ShardSender | None = None
        self.redis_state = recovery.RedisState(self.holder)
        self.held: dict[str, leases.Lease] = {}  # by delivery tag
        self.timers: list[Any] = []

    def start(self, c: Any) -> None:
        global _keeper
        self.client = redis.Redis.from_url(
            str(c.app.conf.broker_url), socket_timeout=_REDIS_TIMEOUT_S, socket_connect_timeout=_REDIS_TIMEOUT_S
        )
        _keeper = self
        try:
            self.redis_state.adopt(self.client)  # the Redis state this worker starts with (once per process)
        except redis.RedisError as exc:  # the first reap adopts it instead
            logger.warning("cannot read the Redis state marker: %s", exc)
        self.timers = [
            c.timer.call_repeatedly(self.lease_s / 4, self.renew, priority=10),
            c.timer.call_repeatedly(self.reaper_interval_s, self.reap, priority=10),
        ]
        logger.info(
            "shard leases: holder %s, lease %.0fs, reaper every %.0fs",
            self.holder,
            self.lease_s,
            self.reaper_interval_s,
        )

    def stop(self, c: Any) -> None:
        # Also on a consumer restart (broker connection lost), after which the consumer starts again.
        self._stop_timers()
        if state.should_stop is None and state.should_terminate is None:
            self._hand_back_dropped()

    def _stop_timers(self) -> None:
        global _keeper
        for timer in self.timers:
            timer.cancel()
        self.timers = []
        if _keeper is self:
            _keeper = None

    def _hand_back_dropped(self) -> None:
        """A lost broker connection makes Celery drop every message it had received but not started (a prefetched
        shard, a retry waiting for its countdown): they stay in the broker's unacknowledged set, which only the
        visibility timeout (hours) would put back in the queue. Their leases go back to the reaper, which returns
        those messages to the queue within a lease period; the shards running now keep theirs, and run on."""
        running = {str(request.message.delivery_tag) for request in tuple(state.active_requests)}
        dropped = [tag for tag in self.held if tag not in running]
        for tag in dropped:
            lease = self.held.pop(tag)
            handed_back = False
            # With Redis down too it cannot be handed back now; no longer renewed, it expires within a lease period.
            # A lease Redis never got (killed between the delivery and the lease) is for the reaper's sweep of
            # deliveries without one.
            with contextlib.suppress(redis.RedisError):
                if self.client is not None:
                    handed_back = leases.hand_back(self.client, lease)
            logger.warning(
                "shard %d of job %s was waiting in this worker when the broker connection was lost: %s",
                lease.shard_index,
                lease.job_id,
                "handed back to the lease reaper, which returns it to the queue"
                if handed_back
                else "the lease reaper returns it to the queue once its lease expires, or a lease period after its "
                "delivery if Redis holds no lease of it",
            )

    def shutdown(self, c: Any) -> None:
        # The worker is going away and its unacknowledged messages go back to the queue with the connection:
        # their leases go too, or the reaper would send those shards a second time.
        self._stop_timers()
        if self.client is not None:
            for lease in self.held.values():
                try:
                    leases.release(self.client, lease)
                except redis.RedisError as exc:
                    logger.warning(
                        "cannot release the lease of shard %d of job %s: %s", lease.shard_index, lease.job_id, exc
                    )
        self.held.clear()

    def lease_of(self, request: Request) -> leases.Lease | None:
        try:
            job_id, shard_index = request.args
        except ValueError:
            logger.warning("task %s %s: not (job_id, shard_index) arguments, not leased", request.name, request.id)
            return None
        return leases.Lease(
            task=request.name,
            task_id=request.id,
            job_id=str(job_id),
            shard_index=int(shard_index),
            holder=self.holder,
            delivery_tag=str(request.message.delivery_tag),
        )

    def acquire(self, request: Request) -> None:
        lease = self.lease_of(request)
        if lease is None or self.client is None:
            return
        self.held[lease.delivery_tag] = lease
        try:
            leases.acquire(self.client, lease, self.lease_s)
        except redis.RedisError as exc:  # the next renewal will not find it; the broker's timeout still applies
            logger.warning("cannot lease shard %d of job %s: %s", lease.shard_index, lease.job_id, exc)

    def finish(self, request: Request, *, settled: bool, requeued: bool) -> None:
        """The message was acknowledged or rejected: release the lease if the shard's fate is settled, else hand it
        back to the reaper. Either way this worker stops renewing it, so that with Redis unreachable it expires."""
        lease = self.held.pop(str(request.message.delivery_tag), None)
        if lease is None or self.client is None:
            return
        try:
            if not settled:
                leases.hand_back(self.client, lease)
                logger.warning(
                    "shard %d of job %s ended without success or retry: the lease reaper sends it again unless "
                    "storage holds its manifest or dead letter",
                    lease.shard_index,
                    lease.job_id,
                )
                return
            leases.release(self.client, lease)
            if requeued:
                leases.count_rerun(self.client, lease.job_id)
                logger.warning(
                    "shard %d of job %s returned to the queue (its pool process was lost or the worker is stopping)",
                    lease.shard_index,
                    lease.job_id,
                )
        except redis.RedisError as exc:  # the lease is no longer renewed: it expires, at worst one harmless re-run
            logger.warning("cannot end the lease of shard %d of job %s: %s", lease.shard_index, lease.job_id, exc)

    def renew(self) -> None:
        if self.client is None or not self.held:
            return
        try:
            leases.renew(self.client, self.holder, list(self.held.values()), self.lease_s)
        except redis.RedisError as exc:
            logger.warning("cannot renew %d shard lease(s): %s", len(self.held), exc)

    def reap(self) -> None:
        if self.client is None:
            return
        connection = None
        try:
            if self.storage is None:
                self.storage = open_storage(self.storage_url, self.settings)
            if self.sender is None:
                self.sender = ShardSender(str(self.app.conf.broker_url))

            def channel() -> Any:
                nonlocal connection
                if connection is None:  # only when a lease expired: most intervals need no broker connection
                    connection = self.app.connection_for_write()
                return connection.default_channel

            def restore(delivery: leases.Lease | Delivery) -> bool:
                if not channel().client.hexists(channel().unacked_key, delivery.delivery_tag):
                    return False
                channel().qos.restore_by_tag(delivery.delivery_tag)
                return True

            def resend(lease: leases.Lease) -> None:
                self.app.send_task(lease.task, args=[lease.job_id, lease.shard_index], task_id=lease.task_id)

            leases.reap(self.client, self.storage, restore=restore, resend=resend)
            leases.return_unleased(
                self.client, self.storage, older_than_s=self.lease_s, every_s=self.reaper_interval_s, restore=restore
            )
            self.redis_state.check(self.storage, self.client, enqueue=self.sender.send)
            recovery.take_over_stalled_publishing(
                self.storage, self.client, enqueue=self.sender.send, stalled_after_s=self.lease_s
            )
            recovery.resend_lost_shards(
                self.storage, self.client, enqueue=self.sender.send, quiet_for_s=LOST_SHARD_QUIET_LEASES * self.lease_s
            )
        except Exception as exc:  # never let the reaper take the consumer down; the next interval tries again
            logger.warning("lease reaper: %s: %s", type(exc).__name__, exc)
        finally:
            if connection is not None:
                connection.release()

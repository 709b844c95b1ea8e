"""Which jobs a running trainer follows (`eagle3 train --follow`), so that a job is not deleted, nor its shard events
trimmed, under a trainer that still reads them.

A following trainer refreshes its entry in `eagle3:job:{job_id}:followers` (a sorted set: follower -> expiry, Redis
server time) every FOLLOWER_TTL_S / 3 from a thread of its own; a trainer that stops, however it stops, drops out
FOLLOWER_TTL_S later at most. The key itself expires with its last entry, so nothing is left behind.
"""

import logging
import os
import socket
import threading
import uuid

import redis

from shared.lifecycle import progress
from shared.redis_replies import text

logger = logging.getLogger(__name__)

FOLLOWER_TTL_S = 60

# ARGV: follower, ttl. The score is the Redis server's clock, so that the trainer's and the producer's may disagree.
_MARK = """
local t = redis.call('TIME')
local now = tonumber(t[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""

_LIVE = """
local t = redis.call('TIME')
return redis.call('ZRANGEBYSCORE', KEYS[1], tonumber(t[1]), '+inf')
"""


def followers_key(job_id: str) -> str:
    return f"{progress.job_key(job_id)}:followers"


def mark(client: redis.Redis, job_id: str, follower: str, ttl_s: float = FOLLOWER_TTL_S) -> None:
    client.eval(_MARK, 1, followers_key(job_id), follower, int(ttl_s))


def unmark(client: redis.Redis, job_id: str, follower: str) -> None:
    client.zrem(followers_key(job_id), follower)


def live_followers(client: redis.Redis, job_id: str) -> list[str]:
    """The followers whose last refresh has not expired."""
    return [text(m) for m in client.eval(_LIVE, 1, followers_key(job_id))]


class FollowerMark:
    """A trainer's entry among a job's followers, refreshed by a daemon thread until `stop()` or the process ends."""

    def __init__(self, client: redis.Redis, job_id: str, ttl_s: float = FOLLOWER_TTL_S) -> None:
        self.client, self.job_id, self.ttl_s = client, job_id, ttl_s
        self.name = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._stopped = threading.Event()
        mark(client, job_id, self.name, ttl_s)  # before the thread: the job is marked once the follower exists
        self._thread = threading.Thread(target=self._refresh, name=f"follow-{job_id}", daemon=True)
        self._thread.start()

    def _refresh(self) -> None:
        while not self._stopped.wait(self.ttl_s / 3):
            try:
                mark(self.client, self.job_id, self.name, self.ttl_s)
            except redis.RedisError as exc:  # an outage: the next refresh tries again, the entry may lapse meanwhile
                logger.warning("cannot refresh the follower mark of job %s: %s", self.job_id, exc)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        try:
            unmark(self.client, self.job_id, self.name)
        except redis.RedisError as exc:
            logger.warning("cannot remove the follower mark of job %s (it expires by itself): %s", self.job_id, exc)

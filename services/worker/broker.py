"""The worker's broker transport: kombu's Redis transport, but a channel whose connection was already closed does not
take the worker down when it is closed in turn.

Celery 5.7 closes the broker connection as soon as it finds it lost, and closing it closes its channel, which first
tries to return the messages it holds unacknowledged to the queue. By then kombu has cut the transport from its
connection, so building a Redis client for that fails with an AttributeError that nothing catches ("Unrecoverable
error: 'NoneType' object has no attribute 'hostname'"): the worker stops whenever the broker goes away while it holds
a message it has not started (a prefetched shard, a retry waiting for its countdown). Here that attempt fails as a
connection error, which kombu's close ignores, as it would with the broker unreachable; those messages go back to the
queue through their shard leases instead (services/worker/leasing.py).
"""

from typing import Any

import redis
from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection.client is None:
            raise redis.ConnectionError("the broker connection is closed")
        params: dict[str, Any] = super()._connparams(asynchronous=asynchronous)
        return params


class Transport(kombu_redis.Transport):
    Channel = Channel


# What the worker's Celery app names as its broker transport (app.conf.broker_transport) for redis:// and rediss://
# URLs, which kombu would otherwise map to kombu_redis.Transport.
TRANSPORT = f"{__name__}:Transport"
SCHEMES = ("redis", "rediss")

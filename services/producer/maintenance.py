"""The producer's upkeep on a schedule, in a thread of its own: the retention (EAGLE3_RETENTION_DAYS), the trimming of
finished jobs' shard events (shared/lifecycle/deletion.py) and the measurement of what the store holds besides the
committed samples, which the storage budget counts (shared/lifecycle/budget.py), at start and every
EAGLE3_MAINTENANCE_INTERVAL_S."""

import logging
import threading

import redis

from services.producer.deps import get_redis, get_storage
from shared.errors import Eagle3Error
from shared.lifecycle import budget, deletion
from shared.settings import Settings

logger = logging.getLogger(__name__)


class Maintenance:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="maintenance", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            try:
                storage, client = get_storage(self.settings), get_redis(self.settings)
                deletion.maintain(storage, client, self.settings)
                budget.measure_other_bytes(client, storage)
            except (Eagle3Error, redis.RedisError) as exc:  # Redis or storage down: the next round tries again
                logger.warning("maintenance round failed, next in %.0fs: %s", self.settings.maintenance_interval_s, exc)
            if self._stopped.wait(self.settings.maintenance_interval_s):
                return

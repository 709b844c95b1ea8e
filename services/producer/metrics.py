"""Prometheus metrics for every job, computed from Redis at scrape time so any producer replica agrees."""

from collections.abc import Iterator

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from shared.lifecycle import budget, progress, shard_metrics
from shared.lifecycle.kinds import KINDS
from shared.ops import cluster, timeline
from shared.settings import Settings

_GAUGES = {
    "samples_total": "Samples planned (after rejections)",
    "samples_done": "Samples committed",
    "samples_rejected": "Samples rejected at tokenization",
    "samples_failed": "Samples in dead-lettered shards",
    "tokens_total": "Prompt tokens planned",
    "tokens_done": "Prompt tokens committed",
    "shards_total": "Shards planned",
    "shards_committed": "Shards committed",
    "shards_dead_lettered": "Shards dead-lettered",
    "bytes_stored": "Bytes of committed sample files",
    "projected_total_bytes": "Projected bytes when the job completes",
    "tokens_per_second": "Committed tokens per second over the recent window",
    "eta_seconds": "Seconds to completion at the recent rate",
}
# Each kind's own counters (JobKind.counters), with their help as the kind declares it. A regenerate job's tokens
# above are generated tokens; its counters count conversations and turns.
_KIND_GAUGES = {name: doc for kind in KINDS.values() for name, doc in kind.counters.items()}


class JobsCollector(Collector):
    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.client, self.settings = client, settings

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        families = {
            name: GaugeMetricFamily(f"eagle3_job_{name}", doc, labels=["job_id", "state"])
            for name, doc in _GAUGES.items()
        }
        kind_counters = {
            name: GaugeMetricFamily(f"eagle3_job_{name}", doc, labels=["job_id", "state"])
            for name, doc in _KIND_GAUGES.items()
        }
        reruns = CounterMetricFamily(
            "eagle3_job_shards_rerun",
            "Shards run again after their worker died, lost its pool process or stopped (lease expired or requeued)",
            labels=["job_id", "state"],
        )
        since_commit = GaugeMetricFamily(
            "eagle3_job_seconds_since_commit",
            "Seconds since the job's last committed shard (or since it was created)",
            labels=["job_id", "state"],
        )
        stalled = GaugeMetricFamily(
            "eagle3_job_stalled",
            "1 when the job is queued or running and committed nothing for EAGLE3_STALL_AFTER_S",
            labels=["job_id", "state"],
        )
        store_budget = budget.store_budget(self.client, self.settings)  # as `eagle3 budget` last set it
        for job_id in progress.list_jobs(self.client):
            p = progress.job_progress(
                self.client, job_id, window_s=self.settings.progress_window_s, budget_bytes=store_budget
            )
            for name, family in families.items():
                value = getattr(p, name)
                if value is not None:
                    family.add_metric([job_id, p.state], float(value))
            reruns.add_metric([job_id, p.state], float(p.shards_rerun))
            for name, value in p.counters.items():  # its kind's own, as the kind declares them
                if name in kind_counters:
                    kind_counters[name].add_metric([job_id, p.state], float(value))
            activity = timeline.job_activity(self.client, p, stall_after_s=self.settings.stall_after_s)
            since_commit.add_metric([job_id, p.state], activity.seconds_since_commit)
            stalled.add_metric([job_id, p.state], float(activity.stalled))
        yield from families.values()
        yield from kind_counters.values()
        yield reruns
        yield since_commit
        yield stalled
        # What the store-wide budget counts, and the budget itself when there is one: the headroom to alert on.
        yield GaugeMetricFamily(
            "eagle3_storage_stored_bytes",
            "Bytes stored: every job's committed samples and the rest of the store as last measured",
            value=float(budget.stored_bytes(self.client)),
        )
        if store_budget is not None:
            yield GaugeMetricFamily(
                "eagle3_storage_budget_bytes",
                "The store-wide storage budget in force (EAGLE3_STORAGE_BUDGET_BYTES, or as `eagle3 budget` set it)",
                value=float(store_budget),
            )


class ClusterCollector(Collector):
    """What an on-call engineer watches across jobs: the queue, the workers, shard latency, bytes written, failures."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.client, self.settings = client, settings

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        queue = cluster.queue_depth(self.client)
        depth = GaugeMetricFamily("eagle3_queue_depth", "Shard messages waiting in the queue", labels=["queue"])
        depth.add_metric([queue.queue], queue.depth)
        oldest = GaugeMetricFamily(
            "eagle3_queue_oldest_message_age_seconds",
            "How long the longest-waiting shard message has waited (0 when the queue is empty)",
            labels=["queue"],
        )
        oldest.add_metric([queue.queue], queue.oldest_age_s or 0.0)
        in_flight = GaugeMetricFamily("eagle3_queue_unacked", "Shard messages delivered and not yet acknowledged")
        in_flight.add_metric([], queue.in_flight)
        yield from (depth, oldest, in_flight)

        workers = cluster.list_workers(self.client, stale_after_s=3 * self.settings.worker_heartbeat_interval_s)
        alive = GaugeMetricFamily("eagle3_workers", "Workers seen in the last day, by liveness", labels=["state"])
        alive.add_metric(["alive"], sum(w.alive for w in workers))
        alive.add_metric(["silent"], sum(not w.alive for w in workers))
        heartbeat = GaugeMetricFamily(
            "eagle3_worker_seconds_since_heartbeat", "Seconds since the worker's last beat", labels=["worker"]
        )
        held = GaugeMetricFamily("eagle3_worker_held_shards", "Shards the worker is running", labels=["worker"])
        for w in workers:
            heartbeat.add_metric([w.name], w.seconds_since_heartbeat)
            held.add_metric([w.name], len(w.holding))
        yield from (alive, heartbeat, held)

        latency = HistogramMetricFamily(
            "eagle3_shard_duration_seconds", "Time to capture, validate and commit one shard", labels=["task"]
        )
        written = CounterMetricFamily(
            "eagle3_shard_bytes_written", "Bytes of committed shards (rate() is bytes/s)", labels=["task"]
        )
        tokens = CounterMetricFamily("eagle3_shard_tokens_written", "Tokens of committed shards", labels=["task"])
        for h in shard_metrics.shard_histograms(self.client):
            latency.add_metric([h.task], [(_bound(b), count) for b, count in h.buckets], h.sum_s)
            written.add_metric([h.task], h.bytes_written)
            tokens.add_metric([h.task], h.tokens_written)
        failures = CounterMetricFamily(
            "eagle3_shard_failures",
            "Shard attempts that failed: outcome retry (runs again) or dead_lettered, by exception type",
            labels=["task", "outcome", "reason"],
        )
        for f in shard_metrics.failure_counts(self.client):
            failures.add_metric([f.task, f.outcome, f.reason], f.count)
        yield from (latency, written, tokens, failures)


def _bound(upper: float) -> str:
    return "+Inf" if upper == float("inf") else str(upper)

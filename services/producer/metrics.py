"""Prometheus metrics for every job, computed from Redis at scrape time so any producer replica agrees."""

from collections.abc import Iterator

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shared import progress
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
# Regenerate jobs: their tokens above are generated tokens; these count conversations.
_REGENERATION_GAUGES = {
    "turns_done": "Assistant turns regenerated",
    "conversations_with_reasoning": "Regenerated conversations with reasoning text",
    "conversations_truncated": "Regenerated conversations with a turn cut at max_new_tokens",
    "conversations_empty": "Regenerated conversations with an empty turn",
    "conversations_failed": "Conversations that failed, recorded with their reason",
}


class JobsCollector(Collector):
    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.client, self.settings = client, settings

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        families = {
            name: GaugeMetricFamily(f"eagle3_job_{name}", doc, labels=["job_id", "state"])
            for name, doc in _GAUGES.items()
        }
        regeneration = {
            name: GaugeMetricFamily(f"eagle3_job_{name}", doc, labels=["job_id", "state"])
            for name, doc in _REGENERATION_GAUGES.items()
        }
        reruns = CounterMetricFamily(
            "eagle3_job_shards_rerun",
            "Shards run again after their worker died, lost its pool process or stopped (lease expired or requeued)",
            labels=["job_id", "state"],
        )
        for job_id in progress.list_jobs(self.client):
            p = progress.job_progress(
                self.client,
                job_id,
                window_s=self.settings.progress_window_s,
                budget_bytes=self.settings.storage_budget_bytes,
            )
            for name, family in families.items():
                value = getattr(p, name)
                if value is not None:
                    family.add_metric([job_id, p.state], float(value))
            reruns.add_metric([job_id, p.state], float(p.shards_rerun))
            if p.regeneration is not None:
                for name, family in regeneration.items():
                    family.add_metric([job_id, p.state], float(getattr(p.regeneration, name)))
        yield from families.values()
        yield from regeneration.values()
        yield reruns

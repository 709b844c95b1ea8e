"""The audit every fault scenario ends with, read from storage alone (storage is the truth):

- every input sample (from the job's shard inputs) is in exactly one manifest entry: `committed_once`, else
  `duplicated` (in several entries) or `lost` (in none);
- every manifest entry's object exists with the manifest's size and sha256, else it is `torn`;
- no object under the job is outside a manifest except the job's own files (`stray`: a sample file no manifest
  names, a dead letter, anything else).
"""

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field

from shared.lifecycle.jobs import load_job
from shared.lifecycle.schemas import Manifest
from shared.storage import layout
from shared.storage.objects import ObjectNotFound, Storage

# The job's own files besides its manifests and the sample files they name.
_OWN_FILES = re.compile(
    r"(job\.json|vocab_mapping\.pt|rejected\.jsonl|dataset\.jsonl|cancelled|inputs/shard_\d{6}\.json)"
)


@dataclass
class Audit:
    job_id: str
    samples_expected: int
    committed_once: int
    duplicated: int
    lost: int
    torn: list[str] = field(default_factory=list)
    stray: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return (
            self.committed_once == self.samples_expected
            and not self.duplicated
            and not self.lost
            and not self.torn
            and not self.stray
        )

    def explain(self) -> str:
        return (
            f"job {self.job_id}: {self.committed_once}/{self.samples_expected} committed once, "
            f"{self.duplicated} duplicated, {self.lost} lost, torn {self.torn[:5]}, stray {self.stray[:5]}"
        )


def audit_job(storage: Storage, job_id: str) -> Audit:
    job = load_job(storage, job_id)
    expected: set[int] = set()
    for shard_index in range(job.shards_total):
        shard = json.loads(storage.get(layout.shard_input(job_id, shard_index)))
        expected.update(s["sample_index"] for s in shard["samples"])

    keys = set(storage.list(f"{job_id}/"))
    manifest_keys = sorted(k for k in keys if k.startswith(layout.manifests_prefix(job_id)))
    entries: Counter[int] = Counter()
    named: set[str] = set(manifest_keys)
    torn: list[str] = []
    for key in manifest_keys:
        manifest = Manifest.model_validate_json(storage.get(key))
        for sample in manifest.samples:
            entries[sample.sample_index] += 1
            named.add(sample.key)
            try:
                data = storage.get(sample.key)
            except ObjectNotFound:
                torn.append(f"{sample.key} (missing)")
                continue
            if len(data) != sample.bytes or hashlib.sha256(data).hexdigest() != sample.sha256:
                torn.append(f"{sample.key} ({len(data)} bytes, manifest says {sample.bytes})")
    stray = sorted(k for k in keys - named if not _OWN_FILES.fullmatch(k.removeprefix(f"{job_id}/")))
    return Audit(
        job_id=job_id,
        samples_expected=len(expected),
        committed_once=sum(1 for i in expected if entries[i] == 1),
        duplicated=sum(1 for i in expected if entries[i] > 1),
        lost=sum(1 for i in expected if entries[i] == 0),
        torn=torn,
        stray=stray,
    )

"""The audit every fault scenario ends with, read from storage alone (storage is the truth):

- every input sample (from the job's shard inputs) is in exactly one manifest entry: `committed_once`, else
  `duplicated` (in several entries) or `lost` (in none);
- every manifest entry's object exists with the manifest's size and sha256, else it is `torn`;
- no object under the job is outside a manifest except the job's own files (`stray`: a sample file no manifest
  names, a dead letter, anything else).
"""

import hashlib
import re
from collections import Counter
from dataclasses import dataclass, field

from shared.lifecycle.jobs import load_job
from shared.lifecycle.kind import read_shard_input
from shared.lifecycle.kinds import KINDS
from shared.lifecycle.schemas import ConversationResult, JobRecord, Manifest, RegenerationManifest
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

    @classmethod
    def of(
        cls, job_id: str, expected: set[int], entries: Counter[int], *, torn: list[str], stray: list[str]
    ) -> "Audit":
        """From how many manifest entries name each expected sample."""
        return cls(
            job_id=job_id,
            samples_expected=len(expected),
            committed_once=sum(1 for i in expected if entries[i] == 1),
            duplicated=sum(1 for i in expected if entries[i] > 1),
            lost=sum(1 for i in expected if entries[i] == 0),
            torn=torn,
            stray=stray,
        )

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


def _planned(storage: Storage, job_id: str) -> tuple[JobRecord, set[int], set[str], list[str]]:
    """A job's record, the sample indices its shards were planned with (as its kind reads a shard input), every key
    under the job and its manifests' keys, in order."""
    job = load_job(storage, job_id)
    kind = KINDS[job.kind]
    expected = {
        item.sample_index
        for shard_index in range(job.shards_total)
        for item in kind.items(read_shard_input(kind, storage, job_id, shard_index))
    }
    keys = set(storage.list(f"{job_id}/"))
    return job, expected, keys, sorted(k for k in keys if k.startswith(layout.manifests_prefix(job_id)))


def audit_job(storage: Storage, job_id: str) -> Audit:
    _, expected, keys, manifest_keys = _planned(storage, job_id)
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
    return Audit.of(job_id, expected, entries, torn=torn, stray=stray)


# A regenerate job's own files besides its manifests and the conversation records and shard outputs they name.
_OWN_REGENERATE_FILES = re.compile(
    r"(job\.json|rejected\.jsonl|cancelled|inputs/shard_\d{6}\.json|tokenizer/.+|regenerated\.jsonl|failed\.jsonl"
    r"|regeneration\.json)"
)


def audit_regenerate_job(storage: Storage, job_id: str) -> Audit:
    """`audit_job` for a regenerate job (docs/regeneration.md): every input conversation in exactly one manifest
    entry; every entry's conversation record present and about that conversation, every shard output matching its
    manifest's size and sha256, and the assembled dataset (once written) the shard outputs in shard order, else
    `torn`; nothing else under the job but its own files (`stray`)."""
    job, expected, keys, manifest_keys = _planned(storage, job_id)
    entries: Counter[int] = Counter()
    named: set[str] = set(manifest_keys)
    torn: list[str] = []
    outputs: list[tuple[int, bytes]] = []
    for key in manifest_keys:
        manifest = RegenerationManifest.model_validate_json(storage.get(key))
        named.add(manifest.output_key)
        try:
            data = storage.get(manifest.output_key)
        except ObjectNotFound:
            torn.append(f"{manifest.output_key} (missing)")
        else:
            if len(data) != manifest.bytes or hashlib.sha256(data).hexdigest() != manifest.sha256:
                torn.append(f"{manifest.output_key} ({len(data)} bytes, manifest says {manifest.bytes})")
            outputs.append((manifest.shard_index, data))
        for entry in manifest.conversations:
            entries[entry.sample_index] += 1
            named.add(entry.key)
            try:
                record = ConversationResult.model_validate_json(storage.get(entry.key))
            except ObjectNotFound:
                torn.append(f"{entry.key} (missing)")
                continue
            if record.sample_index != entry.sample_index:
                torn.append(f"{entry.key} (conversation {record.sample_index}, manifest says {entry.sample_index})")
    assembled = layout.regenerated_dataset(job_id)
    whole = assembled in keys and len(outputs) == job.shards_total
    if whole and storage.get(assembled) != b"".join(data for _, data in sorted(outputs)):
        torn.append(f"{assembled} (not the shard outputs in order)")
    stray = sorted(k for k in keys - named if not _OWN_REGENERATE_FILES.fullmatch(k.removeprefix(f"{job_id}/")))
    return Audit.of(job_id, expected, entries, torn=torn, stray=stray)

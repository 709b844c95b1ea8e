"""Domain exceptions. Every error names what failed (sample, shard, field) and why."""


class Eagle3Error(Exception):
    """Base class of every error this project raises on purpose."""


class ConfigurationError(Eagle3Error):
    """A setting or job spec value that cannot work."""


class InvalidSample(Eagle3Error):
    """One dataset record that cannot become a training sample; the rest of the job goes on."""

    def __init__(self, sample_id: str, field: str, reason: str) -> None:
        super().__init__(f"sample {sample_id}: {field}: {reason}")
        self.sample_id, self.field, self.reason = sample_id, field, reason


class SubmitError(Eagle3Error):
    """A job cannot be submitted (missing dataset or model, unreachable storage or queue)."""


class JobExists(SubmitError):
    """A submit names a job id that is taken: the job exists, or its earlier submit got as far as job.json (a reaper
    finishes that one's publishing)."""


class DependencyUnavailable(SubmitError):
    """Redis or storage cannot be reached at submit time."""


class OverBudget(SubmitError):
    """The job's projected storage exceeds the configured budget."""


class JobNotFound(Eagle3Error):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id!r} not found")
        self.job_id = job_id


class TransientError(Eagle3Error):
    """An outage that a retry with backoff can fix."""


class InferenceUnavailable(TransientError):
    """The inference server refused, timed out, or answered 5xx."""


class QueueUnavailable(TransientError):
    """Redis (the queue and the jobs' progress) cannot be reached."""


class StorageUnavailable(TransientError):
    """The object store refused, timed out, throttled, or is full."""


class StorageFull(StorageUnavailable):
    """The object store (or disk) has no room or the quota is spent: the job pauses until there is room."""


class OverStorageBudget(StorageFull):
    """A shard would take the stored bytes past a storage budget (EAGLE3_STORAGE_BUDGET_BYTES or the job's own): the
    job pauses like on a full store, and goes on once a delete makes room or the budget is raised."""


class DeleteRefused(Eagle3Error):
    """A job cannot be deleted now (it still runs, or a trainer follows it); the message says how to go on."""


class JobDeleting(Eagle3Error):
    """The job is being deleted (a delete began and did not finish): only running the delete again goes on."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id!r} is being deleted: run `eagle3 delete {job_id}` again to finish it")
        self.job_id = job_id


class ProducerUnavailable(TransientError):
    """The producer API (which a finishing regeneration asks to submit the chained job) cannot be reached."""


class InferenceProtocolError(Eagle3Error):
    """The inference server answered 4xx or something that does not follow the capture protocol."""


class ShardValidationError(Eagle3Error):
    """Captured hidden states failed a check before commit; nothing of the shard is committed."""

    def __init__(self, job_id: str, shard_index: int, sample_id: str, field: str, reason: str) -> None:
        super().__init__(f"job {job_id} shard {shard_index} sample {sample_id}: {field}: {reason}")
        self.job_id, self.shard_index = job_id, shard_index
        self.sample_id, self.field, self.reason = sample_id, field, reason


class ModelMismatch(Eagle3Error):
    """The inference server serves a model other than the one the job was planned for."""

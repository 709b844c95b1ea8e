"""Service settings: one typed model, read from the environment (prefix EAGLE3_) or `.env`."""

import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shared.urls import is_loopback, redact_url

DEFAULT_HOME = Path(".eagle3")
# Placeholders from our own examples (.env.example, k8s/base/secret.template.yaml): never a real token.
EXAMPLE_API_TOKENS = {"changethis", "change-me", "<output of: openssl rand -hex 32>"}
MIN_API_TOKEN_CHARS = 16


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EAGLE3_", env_file=".env", extra="ignore")

    # Local state (models, demo files, trainer cache, the embedded storage); first, so later defaults can use it
    home: Path = DEFAULT_HOME

    # Queue and storage
    redis_url: str = "redis://127.0.0.1:6379/0"
    storage_url: str = Field(
        default_factory=lambda fields: (fields["home"] / "storage").resolve().as_uri(),
        description="file:///abs/dir (embedded default: {home}/storage) or s3://bucket/prefix",
    )
    s3_endpoint_url: str | None = None
    s3_region: str = "us-east-1"
    s3_multipart_threshold_bytes: int = 64 * 1024 * 1024
    s3_multipart_chunk_bytes: int = 64 * 1024 * 1024
    s3_max_concurrency: int = 8
    file_fsync: bool = Field(
        default=False, description="fsync every file:// object: survives power loss, at disk speed"
    )
    storage_budget_bytes: int | None = Field(
        default=None,
        description="everything stored (all jobs' measured bytes): a submit projected above it is refused, a running "
        "job pauses before a shard would cross it; `eagle3 budget` changes it while running",
    )
    retention_days: float | None = Field(
        default=None,
        gt=0,
        description="the producer deletes finished jobs this many days after they finished (checkpoints kept); "
        "unset: never",
    )
    maintenance_interval_s: float = Field(
        default=600.0,
        gt=0,
        description="how often the producer applies the retention, trims the shard events of finished jobs and "
        "measures what the store holds besides the committed samples (for the storage budget)",
    )

    # Inference
    inference_url: str = "http://127.0.0.1:30000"
    reference_url: str | None = Field(
        default=None,
        description="the transformers reference server (services/inference/reference) an audit recomputes with when "
        "it names no backend: where the workers capture through SGLang, one beside it makes audits independent; "
        "unset: the workers' own server (EAGLE3_INFERENCE_URL)",
    )
    inference_timeout_s: float = Field(
        default=300.0, gt=0, description="per request: a slow prefill or decode of a server that answers /health"
    )
    inference_health_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="abandon outstanding requests once the server's /health has not answered for this long (hung)",
    )
    inference_ready_timeout_s: float = Field(default=300.0, gt=0, description="wait this long for /health")
    inference_concurrency: int = Field(default=4, ge=1, description="in-flight capture requests per worker")
    capture_transport: Literal["body", "shm"] = "body"
    shm_dir: Path = Path("/dev/shm/eagle3")

    # Reference inference server (services/inference/reference)
    inference_host: str = "127.0.0.1"
    inference_port: int = 30000
    inference_device: str = "auto"  # auto, cpu, cuda, cuda:1
    inference_dtype: Literal["auto", "bfloat16", "float32", "float16"] = Field(
        default="auto", description="compute dtype; auto = bf16 on CUDA and on CPUs with native bf16, else fp32"
    )
    inference_max_batch_tokens: int = Field(default=8192, ge=1)
    inference_max_batch_wait_ms: float = Field(default=5.0, ge=0)
    inference_max_decode_batch: int = Field(default=64, ge=1, description="prompts decoded in one generate call")
    inference_decode_batch_wait_ms: float = Field(
        default=50.0, ge=0, description="how long a decode request waits for others to batch with"
    )

    # Regeneration (workers)
    regenerate_concurrency: int = Field(default=16, ge=1, description="conversations decoded at once per shard task")

    # Worker delivery
    write_concurrency: int = Field(default=4, ge=1, description="sample files validated and written in parallel")
    worker_concurrency: int = Field(default=1, ge=1)
    visibility_timeout_s: int = 4 * 3600
    redelivery_sweep_s: float = Field(default=30.0, gt=0, description="how often workers look for lost shards")
    task_max_retries: int = 5
    retry_backoff_max_s: int = 300
    storage_wait_s: float = Field(
        default=30.0,
        gt=0,
        description="a shard that found storage full, or unreachable after its retries, runs again after this; the "
        "job is paused meanwhile",
    )
    soft_shutdown_timeout_s: float = 60.0
    worker_heartbeat_file: Path = Path("/tmp/eagle3-worker-heartbeat")
    worker_heartbeat_interval_s: float = Field(default=15.0, gt=0, description="liveness file touch period")
    shard_lease_s: float = Field(
        default=60.0, gt=0, description="a shard whose worker stops renewing its lease for this long runs again"
    )
    lease_reaper_interval_s: float = Field(default=15.0, gt=0, description="how often workers look for expired leases")
    redis_outage_wait_s: float = Field(
        default=60.0,
        gt=0,
        description="a shard's Redis calls retry for about this long through a Redis outage (restart, failover); "
        "a longer outage hands the shard back to the lease reaper. A worker told to stop exits once Redis has not "
        "answered for this long",
    )

    # Producer API
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    api_url: str = "http://127.0.0.1:8000"
    api_token: SecretStr | None = Field(
        default=None,
        description="bearer token of the API; the producer refuses to start without one unless api_auth=off",
    )
    api_auth: Literal["on", "off"] = Field(
        default="on", description="off: no token at all, accepted only when api_host is a loopback address"
    )
    api_max_request_bytes: int = Field(default=1024 * 1024, ge=1, description="413 above this (JSON bodies)")
    api_max_upload_bytes: int = Field(default=1024**3, ge=1, description="413 above this (POST /v1/jobs/upload)")
    # Where jobs may read from (shared/access.py). Each a local folder or s3://bucket/prefix, as a JSON list or
    # comma-separated; none: local datasets are refused (uploads and the storage bucket always work).
    dataset_roots: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Local folders target models may come from; unset: model_path's parent and {home}/models.
    model_roots: Annotated[list[Path] | None, NoDecode] = None

    # Target model default (a local Hugging Face folder)
    model_path: Path | None = None
    progress_window_s: float = 60.0
    stall_after_s: float = Field(
        default=900.0, gt=0, description="a queued or running job that commits nothing for this long is stalled"
    )
    demo_regenerate: bool = Field(
        default=True, description="`eagle3 demo` regenerates the demo conversations with the target first"
    )

    @field_validator("dataset_roots", "model_roots", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.strip()
            return json.loads(value) if value.startswith("[") else [v.strip() for v in value.split(",") if v.strip()]
        return value

    def __repr_args__(self) -> Any:
        # A Redis or S3 endpoint URL may carry a password (redis://:secret@host); SecretStr covers the token.
        for name, value in super().__repr_args__():
            yield name, redact_url(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> "Settings":
        if self.retry_backoff_max_s * 2 >= self.visibility_timeout_s:
            raise ValueError(
                f"visibility_timeout_s={self.visibility_timeout_s} must exceed twice retry_backoff_max_s="
                f"{self.retry_backoff_max_s}, or retried shards are redelivered while they wait"
            )
        if self.api_token is not None:
            token = self.api_token.get_secret_value()
            if token.strip() in EXAMPLE_API_TOKENS or len(token.strip()) < MIN_API_TOKEN_CHARS:
                raise ValueError(
                    f"EAGLE3_API_TOKEN is empty, an example value or shorter than {MIN_API_TOKEN_CHARS} characters: "
                    "set a real secret (openssl rand -hex 32) or unset it"
                )
        if self.api_auth == "off" and not is_loopback(self.api_host):
            raise ValueError(
                f"EAGLE3_API_AUTH=off is accepted only when the API listens on a loopback address, but "
                f"EAGLE3_API_HOST={self.api_host}: set EAGLE3_API_TOKEN instead, or bind to 127.0.0.1"
            )
        return self


@lru_cache
def get_settings() -> Settings:
    return Settings()

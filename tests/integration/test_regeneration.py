"""The regeneration stage against a real Redis and real file storage, with a scripted inference server
(an in-process fake whose answers depend on the prompt), so that reasoning, truncation, empty answers, failures,
outages, cancellation and resume are all reproducible. tests/e2e/test_regeneration.py runs the real server."""

import contextlib
import gc
import json
import re
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from eagle3 import jobs as jobs_cli
from eagle3.cli import build_parser
from services.producer.app import create_app
from services.producer.deps import get_enqueue
from shared.capture.protocol import ModelInfo
from shared.data.tokenization import ChatTokenizer
from shared.errors import (
    ConfigurationError,
    InferenceProtocolError,
    InferenceUnavailable,
    ModelMismatch,
    SubmitError,
)
from shared.lifecycle import jobs, progress, shards
from shared.lifecycle.kind import RECENT_JOBS, ShardContext
from shared.lifecycle.kinds import REGENERATE, kind_of
from shared.lifecycle.kinds import regenerate as regeneration
from shared.lifecycle.schemas import JobRecord, JobSpec, RegenerationManifest
from shared.settings import Settings
from shared.storage import layout
from shared.storage.objects import Storage, open_storage
from tests.datasets import write_dataset

API_TOKEN = "regeneration-test-token-0123456789"

CONVERSATIONS = [
    {
        "id": "multi",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "ORIGINAL-1"},
            {"role": "user", "content": "And then?"},
            {"role": "assistant", "content": "ORIGINAL-2"},
        ],
    },
    {"messages": [{"role": "user", "content": "please think"}, {"role": "assistant", "content": "x"}]},
    {"messages": [{"role": "user", "content": "please fail"}, {"role": "assistant", "content": "x"}]},
    {"conversations": [{"from": "human", "value": "go long"}, {"from": "gpt", "value": "x"}]},
    {"messages": [{"role": "user", "content": "say nothing"}, {"role": "assistant", "content": "x"}]},
    {"messages": [{"role": "user", "content": "an outage"}, {"role": "assistant", "content": "x"}]},
]


class ScriptedInference:
    """Answers like the reference server: "A<prompt length>" per turn, with behaviour picked by the last user turn."""

    base_url = "http://scripted"

    def __init__(
        self, model_dir: Path, *, outages: int = 0, max_context_length: int = 1024, ids_only: bool = False
    ) -> None:
        self.tokenizer = ChatTokenizer.from_pretrained(model_dir).tokenizer
        self.vocab_size = len(self.tokenizer)
        self.outages = outages  # "an outage" fails this many times before it answers
        self.max_context_length = max_context_length
        self.ids_only = ids_only  # like SGLang launched with --skip-tokenizer-init: output_ids, no text
        self.calls: list[tuple[str, dict]] = []

    def wait_ready(self, timeout_s: float) -> None:
        pass

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model_path="/models/tiny",
            tokenizer_path="/models/tiny",
            backend="scripted",
            version="9.9.9",
            num_hidden_layers=8,
            hidden_size=64,
            vocab_size=self.vocab_size,
            default_aux_layer_ids=[1, 3, 4],
            dtype="float32",
            max_context_length=self.max_context_length,
        )

    def generate(self, *, input_ids: list[int], sampling_params: dict, rid: str) -> dict:
        prompt = self.tokenizer.decode(input_ids)
        self.calls.append((prompt, sampling_params))
        last_user = prompt.rsplit("<|im_start|>user\n", 1)[1]
        if "please fail" in last_user:
            raise InferenceProtocolError(f"{self.base_url}/generate rid={rid}: 400 input_ids: nope")
        if "an outage" in last_user and self.outages > 0:
            self.outages -= 1
            raise InferenceUnavailable(f"{self.base_url}/generate rid={rid}: ConnectError")
        text, finish = f"A{len(input_ids)}", {"type": "stop", "matched": 2}
        if "please think" in last_user:
            text = f"<think>\nbecause {len(input_ids)}\n</think>\n\n{text}"
        elif "go long" in last_user:
            finish = {"type": "length", "length": sampling_params["max_new_tokens"]}
        elif "say nothing" in last_user:
            text = ""
        tokens = sampling_params["max_new_tokens"] if finish["type"] == "length" else 3
        if self.ids_only:
            output_ids = [*self.tokenizer(text, add_special_tokens=False).input_ids, self.tokenizer.eos_token_id]
            meta_info = {"finish_reason": finish, "completion_tokens": len(output_ids)}
            return {"output_ids": output_ids, "meta_info": meta_info}
        return {"text": text, "output_ids": [5] * tokens, "meta_info": {"finish_reason": finish}}


class Setup:
    def __init__(self, model_dir: Path, storage: Storage, redis_url: str, dataset: Path) -> None:
        self.model_dir, self.storage, self.dataset = model_dir, storage, dataset
        self.redis = redis.Redis.from_url(redis_url)
        self.settings = Settings(
            redis_url=redis_url,
            storage_url=storage.url,
            api_token=API_TOKEN,
            dataset_roots=[str(dataset.parent)],
            model_roots=[model_dir.parent],
        )
        self.enqueued: list[tuple[str, int]] = []
        self.chained: list[JobSpec] = []

    def submit(self, **spec: object) -> JobRecord:
        return jobs.submit(
            JobSpec(dataset_url=str(self.dataset), model_path=str(self.model_dir), kind="regenerate", **spec),
            settings=self.settings,
            storage=self.storage,
            client=self.redis,
            enqueue=lambda kind, job_id, shard: self.enqueued.append((job_id, shard)),
        )

    def chain(self, spec: JobSpec) -> str:
        self.chained.append(spec)
        return jobs.submit(
            spec,
            settings=self.settings,
            storage=self.storage,
            client=self.redis,
            enqueue=lambda kind, job_id, shard: None,
        ).job_id

    def context(self, inference: ScriptedInference, chain: regeneration.ChainSubmit | None) -> ShardContext:
        state = regeneration.RegenerateState(
            decoding=inference,  # type: ignore[arg-type]
            tokenizers=regeneration.TokenizerCache(),
            chain=chain,
        )
        settings = self.settings.model_copy(update={"regenerate_concurrency": 4})
        return ShardContext(self.storage, self.redis, settings, worker="test", states={"regenerate": state})

    def run(
        self, job_id: str, shard: int, inference: ScriptedInference, *, chain: regeneration.ChainSubmit | None = None
    ) -> shards.ShardOutcome:
        return shards.run_shard(REGENERATE, job_id, shard, self.context(inference, chain or self.chain))


@pytest.fixture
def setup(tiny_model_dir: Path, redis_url: str, tmp_path: Path) -> Setup:
    dataset = tmp_path / "chats.jsonl"
    dataset.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    storage = open_storage((tmp_path / "store").as_uri())
    return Setup(tiny_model_dir, storage, redis_url, dataset)


def lines(storage: Storage, key: str) -> list[dict]:
    return [json.loads(line) for line in storage.get(key).decode().splitlines()]


def test_bad_input_is_rejected_with_the_extractions_rules_and_messages(setup: Setup, tmp_path: Path) -> None:
    dataset, bad_at = write_dataset(tmp_path / "bad.jsonl")
    spec = {
        "dataset_url": str(dataset),
        "model_path": str(setup.model_dir),
        "max_length": 256,
        "length_policy": "reject",
    }
    extraction = jobs.submit(
        JobSpec(**spec),
        settings=setup.settings,
        storage=setup.storage,
        client=setup.redis,
        enqueue=lambda k, j, s: None,
    )
    regenerate = jobs.submit(
        JobSpec(**spec, kind="regenerate"),
        settings=setup.settings,
        storage=setup.storage,
        client=setup.redis,
        enqueue=lambda k, j, s: None,
    )

    def rejected(job_id: str) -> list[dict]:
        return lines(setup.storage, layout.rejected(job_id))

    extraction_rejected, regeneration_rejected = rejected(extraction.job_id), rejected(regenerate.job_id)
    assert {r["line"] for r in extraction_rejected} == set(bad_at.values())
    # Identical records, fields and reasons, plus the one record regeneration cannot take: preformatted text.
    extra = [r for r in regeneration_rejected if r not in extraction_rejected]
    assert [r for r in regeneration_rejected if r in extraction_rejected] == extraction_rejected
    assert [(r["field"], r["reason"]) for r in extra] == [
        ("text", "preformatted text has no turns to regenerate (use messages)")
    ]
    assert regenerate.samples_total == extraction.samples_total - 1


def test_regenerated_conversations_are_written_in_order_with_stats_and_the_chain_submitted(setup: Setup) -> None:
    job = setup.submit(conversations_per_shard=4, max_new_tokens=7, reasoning="drop", then_extract=True)
    assert regeneration.RegenerateRecord.plan_of(job).chained_job_id == f"{job.job_id}-extract"
    assert setup.enqueued == [(job.job_id, 0), (job.job_id, 1)]
    assert job.tokens_total == 7 * 7  # seven assistant turns x max_new_tokens: the upper bound
    assert setup.storage.list(layout.tokenizer_prefix(job.job_id))  # the workers' copy of the chat template
    inference = ScriptedInference(setup.model_dir)

    outcomes = [setup.run(job.job_id, shard, inference) for shard in (0, 1)]

    assert [o.status for o in outcomes] == ["committed", "committed"]
    output = lines(setup.storage, layout.regenerated_dataset(job.job_id))
    assert [r["id"] for r in output] == ["multi", "line-2", "line-4", "line-5", "line-6"]  # "please fail" is out
    multi = output[0]["messages"]
    assert [m["role"] for m in multi] == ["system", "user", "assistant", "user", "assistant"]
    assert [multi[i]["content"] for i in (0, 1, 3)] == ["Be brief.", "Hello there", "And then?"]  # unchanged
    # Each assistant turn is decoded from the regenerated history, not the original one.
    second_prompt = next(p for p, _ in inference.calls if "And then?" in p)
    assert multi[2]["content"] in second_prompt and "ORIGINAL-1" not in second_prompt
    assert multi[4]["content"].startswith("A") and multi[4]["content"] != multi[2]["content"]
    assert output[1]["messages"][1]["content"].startswith("A")  # the think block dropped
    assert output[3]["messages"][1]["content"] == ""  # empty, kept and counted
    assert all(params["max_new_tokens"] == 7 and params["temperature"] == 0 for _, params in inference.calls)

    p = progress.job_progress(setup.redis, job.job_id)
    assert p.state == "completed_with_errors" and p.kind == "regenerate"
    assert (p.samples_done, p.samples_failed, p.samples_total) == (5, 1, 6)
    assert p.tokens_done == p.tokens_total == 3 * 5 + 7  # generated tokens; "go long" hit max_new_tokens
    r = p.regeneration
    assert r is not None and r.finalized and r.chained_job_id == f"{job.job_id}-extract" and r.error is None
    assert (r.turns_done, r.conversations_with_reasoning, r.conversations_truncated) == (6, 1, 1)
    assert (r.conversations_empty, r.conversations_failed) == (1, 1)

    failed = regeneration.failed_conversations(setup.storage, job.job_id)
    assert [(f.sample_id, f.line) for f in failed] == [("line-3", 3)]
    assert "messages[1]" in failed[0].reason and "400 input_ids: nope" in failed[0].reason
    manifest = RegenerationManifest.model_validate_json(setup.storage.get(layout.manifest(job.job_id, 0)))
    assert manifest.server == {"backend": "scripted", "version": "9.9.9", "sglang_version": None}
    assert manifest.sampling_params == {"max_new_tokens": 7, "temperature": 0.0} and manifest.reasoning == "drop"
    summary = json.loads(setup.storage.get(layout.regeneration_summary(job.job_id)))
    assert summary["conversations_written"] == 5 and summary["turns_with_reasoning"] == 1

    # The chain: one extraction job on the regenerated dataset, which takes it as is.
    assert [spec.job_id for spec in setup.chained] == [f"{job.job_id}-extract"]
    chained = jobs.load_job(setup.storage, f"{job.job_id}-extract")
    assert chained.spec.dataset_url.endswith(f"{job.job_id}/regenerated.jsonl")
    assert (chained.samples_total, chained.samples_rejected) == (5, 0)
    assert chained.aux_layer_ids == job.aux_layer_ids

    # Delivered again: nothing decoded, nothing rewritten, the chain not submitted twice.
    calls = len(inference.calls)
    manifest_bytes = setup.storage.get(layout.manifest(job.job_id, 1))
    again = setup.run(job.job_id, 1, inference)
    assert again.status == "already_committed" and len(inference.calls) == calls
    assert setup.storage.get(layout.manifest(job.job_id, 1)) == manifest_bytes and len(setup.chained) == 1
    assert progress.job_progress(setup.redis, job.job_id).tokens_done == p.tokens_done


def test_reasoning_is_kept_as_generated(setup: Setup) -> None:
    job = setup.submit(max_new_tokens=5, reasoning="keep")
    setup.run(job.job_id, 0, ScriptedInference(setup.model_dir))
    output = lines(setup.storage, layout.regenerated_dataset(job.job_id))
    assert output[1]["messages"][1]["content"].startswith("<think>\nbecause ")
    assert progress.job_progress(setup.redis, job.job_id).state == "completed_with_errors"  # "please fail"


def test_a_server_that_answers_only_token_ids_is_decoded_with_the_jobs_tokenizer(setup: Setup) -> None:
    job = setup.submit(max_new_tokens=5, reasoning="drop")
    setup.run(job.job_id, 0, ScriptedInference(setup.model_dir, ids_only=True))
    output = {r["id"]: r["messages"] for r in lines(setup.storage, layout.regenerated_dataset(job.job_id))}
    assert re.fullmatch(r"A\d+", output["multi"][2]["content"])  # the end-of-sequence token skipped
    assert re.fullmatch(r"A\d+", output["line-2"][1]["content"])  # "<think>...</think>" decoded, then dropped
    assert output["line-5"][1]["content"] == ""


def test_an_outage_fails_the_shard_and_the_retry_decodes_only_what_is_missing(setup: Setup) -> None:
    job = setup.submit(max_new_tokens=5)
    inference = ScriptedInference(setup.model_dir, outages=1)

    with pytest.raises(InferenceUnavailable):
        setup.run(job.job_id, 0, inference)
    assert not setup.storage.exists(layout.manifest(job.job_id, 0))
    done = setup.storage.list(f"{job.job_id}/conversations/")
    assert 0 < len(done) < len(CONVERSATIONS)
    calls = len(inference.calls)

    assert setup.run(job.job_id, 0, inference).status == "committed"  # Celery's retry
    retried_prompts = [p for p, _ in inference.calls[calls:]]
    assert len(retried_prompts) == 7 - sum(
        len(json.loads(setup.storage.get(k))["turns"]) + (json.loads(setup.storage.get(k))["error"] is not None)
        for k in done
    )
    assert progress.job_progress(setup.redis, job.job_id).samples_done == 5


def test_a_prompt_longer_than_the_context_is_a_failed_conversation(setup: Setup) -> None:
    job = setup.submit(max_new_tokens=5)
    setup.run(job.job_id, 0, ScriptedInference(setup.model_dir, max_context_length=24))
    failed = regeneration.failed_conversations(setup.storage, job.job_id)
    assert "multi" in {f.sample_id for f in failed}
    reason = next(f.reason for f in failed if f.sample_id == "multi")
    assert "leaves no room to generate within the server's max_context_length 24" in reason


def test_a_server_with_another_model_is_refused(setup: Setup) -> None:
    job = setup.submit()
    inference = ScriptedInference(setup.model_dir)
    inference.model_info = lambda: ModelInfo(  # type: ignore[method-assign]
        model_path="/other",
        tokenizer_path="/other",
        backend="x",
        version="1",
        num_hidden_layers=30,
        hidden_size=576,
        vocab_size=49152,
        default_aux_layer_ids=[1, 14, 26],
        dtype="bfloat16",
        max_context_length=8192,
    )
    with pytest.raises(ModelMismatch, match="hidden_size"):
        setup.run(job.job_id, 0, inference)


def test_cancel_stops_a_shard_and_resume_runs_only_the_shards_not_committed(setup: Setup) -> None:
    job = setup.submit(conversations_per_shard=2, max_new_tokens=5)
    inference = ScriptedInference(setup.model_dir)
    assert setup.run(job.job_id, 0, inference).status == "committed"
    progress.cancel(setup.redis, job.job_id)
    assert setup.run(job.job_id, 1, inference).status == "cancelled"
    assert progress.job_progress(setup.redis, job.job_id).state == "cancelled"
    committed = setup.storage.get(layout.manifest(job.job_id, 0))
    setup.enqueued.clear()

    pending = jobs.resume(job.job_id, storage=setup.storage, client=setup.redis, enqueue=lambda k, j, s: None)

    assert pending == [1, 2]
    for shard in pending:
        setup.run(job.job_id, shard, inference)
    assert setup.storage.get(layout.manifest(job.job_id, 0)) == committed  # skipped, not redone
    p = progress.job_progress(setup.redis, job.job_id)
    assert (p.state, p.samples_done, p.shards_committed) == ("completed_with_errors", 5, 3)
    assert p.regeneration is not None and p.regeneration.finalized
    # Resumed once more, with everything done: nothing to run.
    assert jobs.resume(job.job_id, storage=setup.storage, client=setup.redis, enqueue=lambda k, j, s: None) == []


def test_a_dead_lettered_shard_holds_the_dataset_back_until_resumed(setup: Setup) -> None:
    job = setup.submit(conversations_per_shard=3, max_new_tokens=5)
    inference = ScriptedInference(setup.model_dir)
    setup.run(job.job_id, 0, inference)
    shards.dead_letter(
        REGENERATE,
        job.job_id,
        1,
        InferenceUnavailable("http://scripted/generate: ConnectError"),
        retries=5,
        ctx=setup.context(inference, setup.chain),
    )
    p = progress.job_progress(setup.redis, job.job_id)
    assert (p.state, p.shards_dead_lettered, p.samples_failed) == ("completed_with_errors", 1, 1 + 3)
    assert not setup.storage.exists(layout.regenerated_dataset(job.job_id))
    reasons = {f.sample_index: f.reason for f in regeneration.failed_conversations(setup.storage, job.job_id)}
    assert set(reasons) == {2, 3, 4, 5} and "shard dead-lettered: InferenceUnavailable" in reasons[4]

    enqueued: list[int] = []
    jobs.resume(job.job_id, storage=setup.storage, client=setup.redis, enqueue=lambda k, j, s: enqueued.append(s))
    assert enqueued == [1]
    setup.run(job.job_id, 1, inference)
    p = progress.job_progress(setup.redis, job.job_id)
    assert (p.shards_dead_lettered, p.samples_failed, p.samples_done) == (0, 1, 5)
    assert len(lines(setup.storage, layout.regenerated_dataset(job.job_id))) == 5


@pytest.fixture
def api(setup: Setup) -> Iterator[tuple[TestClient, list[tuple[str, str, int]]]]:
    sent: list[tuple[str, str, int]] = []
    app = create_app(setup.settings)
    app.dependency_overrides[get_enqueue] = lambda: lambda kind, job_id, shard: sent.append((kind, job_id, shard))
    with TestClient(app, headers={"Authorization": f"Bearer {API_TOKEN}"}) as client:
        yield client, sent


def test_the_api_submits_regenerate_jobs_and_shows_their_progress(
    setup: Setup, api: tuple[TestClient, list[tuple[str, str, int]]]
) -> None:
    client, sent = api
    response = client.post(
        "/v1/jobs",
        json={
            "dataset_url": str(setup.dataset),
            "model_path": str(setup.model_dir),
            "kind": "regenerate",
            "max_new_tokens": 5,
            "conversations_per_shard": 3,
            "then_train": True,
        },
    )
    assert response.status_code == 201, response.text
    job = response.json()["job"]
    assert sent == [("regenerate", job["job_id"], 0), ("regenerate", job["job_id"], 1)]
    assert job["spec"]["then_extract"] and job["regeneration"]["assistant_turns_total"] == 7
    body = client.get(f"/v1/jobs/{job['job_id']}").json()
    assert body["progress"]["kind"] == "regenerate" and body["progress"]["state"] == "queued"
    assert body["progress"]["regeneration"]["max_generated_tokens"] == 35

    setup.run(job["job_id"], 0, ScriptedInference(setup.model_dir))
    failed = client.get(f"/v1/jobs/{job['job_id']}/failed").json()
    assert [f["sample_id"] for f in failed] == ["line-3"]
    assert (
        f'eagle3_job_conversations_failed{{job_id="{job["job_id"]}",state="running"}} 1.0'
        in client.get("/metrics").text
    )

    sent.clear()
    assert client.post(f"/v1/jobs/{job['job_id']}/resume").status_code == 200
    assert sent == [("regenerate", job["job_id"], 1)]
    assert client.post("/v1/jobs", json={"dataset_url": "-", "then_extract": True}).status_code == 422


def test_the_trainer_is_pointed_at_the_chained_extraction_job(setup: Setup) -> None:
    def training_job(job_id: str, *, wait_s: float = 0.0) -> str:
        """What the trainer asks (services/trainer/cli.py): the job's kind names the job to train on."""
        job = shards.load_job(setup.storage, job_id)
        return kind_of(job.kind).training_job(setup.storage, job, wait_s=wait_s)

    plain = setup.submit(max_new_tokens=5)
    with pytest.raises(ConfigurationError, match="without then_extract"):
        training_job(plain.job_id)
    job = setup.submit(max_new_tokens=5, then_train=True)
    with pytest.raises(ConfigurationError, match="has not submitted its extraction job"):
        training_job(job.job_id)
    setup.run(job.job_id, 0, ScriptedInference(setup.model_dir))
    assert training_job(job.job_id, wait_s=60) == f"{job.job_id}-extract"
    assert training_job(f"{job.job_id}-extract") == f"{job.job_id}-extract"


def test_the_cli_submits_a_regenerate_job(
    setup: Setup, api: tuple[TestClient, list[tuple[str, str, int]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, sent = api
    monkeypatch.setattr(jobs_cli, "api_client", lambda settings: contextlib.nullcontext(client))
    out = tmp_path / "regenerated.jsonl"
    argv = ["regenerate", str(setup.dataset), "--out", str(out), "--model", str(setup.model_dir)]
    args = build_parser().parse_args([*argv, "--max-new-tokens", "9", "--reasoning", "drop", "--then-extract"])

    args.func(args, setup.settings)

    job = jobs.load_job(setup.storage, sent[0][1])
    options = job.spec.model_dump()
    assert (job.kind, options["max_new_tokens"], options["reasoning"], options["temperature"]) == (
        "regenerate",
        9,
        "drop",
        0,
    )
    assert job.spec.model_dump()["then_extract"] and regeneration.RegenerateRecord.plan_of(job).output_url == str(out)
    assert [kind for kind, _, _ in sent] == ["regenerate"] * job.shards_total


def test_a_refused_chain_is_an_error_and_a_resume_submits_it_again(setup: Setup) -> None:
    job = setup.submit(max_new_tokens=5, then_extract=True)
    refusals = [SubmitError("413 job would store about 9 GB but the storage budget is 1 GB")]

    def chain(spec: JobSpec) -> str:
        if refusals:
            raise refusals.pop()
        return setup.chain(spec)

    setup.run(job.job_id, 0, ScriptedInference(setup.model_dir), chain=chain)
    p = progress.job_progress(setup.redis, job.job_id)
    assert p.state == "completed_with_errors" and p.regeneration is not None
    assert p.regeneration.chained_job_id is None and "storage budget is 1 GB" in (p.regeneration.error or "")
    assert "storage budget" in json.loads(setup.storage.get(layout.regeneration_summary(job.job_id)))["error"]

    enqueued: list[int] = []
    jobs.resume(job.job_id, storage=setup.storage, client=setup.redis, enqueue=lambda k, j, s: enqueued.append(s))
    assert enqueued == [0]  # committed: it only assembles and chains again
    assert setup.run(job.job_id, 0, ScriptedInference(setup.model_dir), chain=chain).status == "already_committed"
    p = progress.job_progress(setup.redis, job.job_id)
    assert p.regeneration is not None and p.regeneration.chained_job_id == f"{job.job_id}-extract"
    assert p.regeneration.error is None


def test_a_worker_keeps_the_tokenizers_of_its_last_jobs_only_and_no_files(
    setup: Setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker process runs any number of jobs: what it keeps per job must not grow with them (kept for every job,
    # the tokenizers grew a pool process by about 9 MB a regenerate job, and their files stayed in /tmp).
    jobs_run = [
        setup.submit(job_id=f"kept-{i}", max_new_tokens=5, conversations_per_shard=3).job_id
        for i in range(RECENT_JOBS + 2)
    ]
    ctx = setup.context(ScriptedInference(setup.model_dir), None)
    downloads = tmp_path / "tmp"
    downloads.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(downloads))
    loaded: list[tuple[Path, weakref.ref]] = []
    load = ChatTokenizer.from_pretrained

    def from_pretrained(path: Path | str) -> ChatTokenizer:
        tokenizer = load(path)
        loaded.append((Path(path), weakref.ref(tokenizer)))
        return tokenizer

    monkeypatch.setattr(ChatTokenizer, "from_pretrained", from_pretrained)

    # The first shard of every job, then the second of the last job (kept) and of the first (gone since).
    for job_id, shard in [*[(job_id, 0) for job_id in jobs_run], (jobs_run[-1], 1), (jobs_run[0], 1)]:
        assert shards.run_shard(REGENERATE, job_id, shard, ctx).status == "committed"

    assert len(loaded) == len(jobs_run) + 1  # the first job's tokenizer loaded again, the last job's not
    gc.collect()
    alive = [ref() is not None for _, ref in loaded]
    assert alive == [False] * (len(loaded) - RECENT_JOBS) + [True] * RECENT_JOBS
    assert len(ctx.prepared) == RECENT_JOBS and jobs_run[0] in ctx.prepared and jobs_run[-1] in ctx.prepared
    assert all(path.parent == downloads for path, _ in loaded) and not any(downloads.iterdir())

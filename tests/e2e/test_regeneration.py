"""Regeneration over real processes: redis-server, a SeaweedFS S3 server, the reference inference server with a
real (tiny random) Llama decoding in batches, two Celery worker processes and the producer API. The regenerated
turns are checked against transformers' own greedy decoding of each regenerated history."""

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from shared.data.datasets import Conversation, InvalidRecord, read_dataset
from shared.lifecycle import progress
from shared.storage import layout
from tests.datasets import BAD_LINES
from tests.e2e.deployment import Deployment, deploy
from tests.fixtures.processes import broker_drained

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 12
CONTEXT = 1024  # the tiny model's max_position_embeddings

GOOD = [
    {
        "id": "multi-turn",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."},
            {"role": "user", "content": "And the boiling point of water?"},
            {"role": "assistant", "content": "Water boils at one hundred degrees Celsius at sea level."},
        ],
    },
    {
        "conversations": [
            {"from": "human", "value": "Can you tell me a joke about computers?"},
            {"from": "gpt", "value": "Artificial intelligence is the branch of engineering."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Hello, how are you doing today?"},
            {"role": "assistant", "content": "I am fine, thank you. What about you?"},
        ]
    },
    {
        "id": "no-room",  # its prompt alone fills the context: recorded as failed, with the reason
        "messages": [
            {"role": "user", "content": "Numbers like 2024 and 12345 are split into digits. " * 120},
            {"role": "assistant", "content": "Indeed."},
        ],
    },
] + [
    {
        "messages": [
            {"role": "user", "content": f"Question {i}: how are you doing today?"},
            {"role": "assistant", "content": "I am fine, thank you. " * (1 + i % 3)},
        ]
    }
    for i in range(4)
]
TEXT_RECORD = {"text": "The capital of France is Paris."}


def write_chats(path: Path, records: list[dict], bad: list[str] = ()) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "".join(line + "\n" for line in bad))
    return path


@pytest.fixture(scope="module")
def deployment(
    tiny_model_dir: Path, redis_server: str, s3_server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    home = tmp_path_factory.mktemp("home")
    # Token-exact comparisons need fp32: in bf16 a batched and an unbatched forward can break a near-tie apart.
    settings = {"regenerate_concurrency": 4, "visibility_timeout_s": 60, "inference_dtype": "float32"}
    with deploy(s3_server, redis_server, tiny_model_dir, home, **settings) as d:
        yield d


def regenerate(deployment: Deployment, dataset: Path, **spec: object) -> dict:
    return deployment.submit(dataset, kind="regenerate", max_new_tokens=MAX_NEW_TOKENS, **spec)


@pytest.fixture(scope="module")
def target(tiny_model_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The target in-process, in the server's compute dtype, decoding one history at a time."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


def greedy_regeneration(
    target: tuple[PreTrainedModel, PreTrainedTokenizerBase], conversation: Conversation
) -> list[dict[str, str]]:
    """What regeneration must produce: each assistant turn greedily decoded by transformers from the regenerated
    history, rendered with the chat template and its generation prompt."""
    model, tokenizer = target
    history: list[dict[str, str]] = []
    for message in conversation.messages:
        if message.role != "assistant":
            history.append({"role": message.role, "content": message.content})
            continue
        text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        prompt = tokenizer(text, add_special_tokens=False).input_ids
        with torch.no_grad():
            output = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=min(MAX_NEW_TOKENS, CONTEXT - len(prompt))
            )[0, len(prompt) :]
        history.append({"role": "assistant", "content": tokenizer.decode(output, skip_special_tokens=True)})
    return history


def test_regenerated_dataset_is_the_targets_greedy_decoding_and_extraction_takes_it(
    deployment: Deployment, target: tuple[PreTrainedModel, PreTrainedTokenizerBase], tmp_path: Path
) -> None:
    bad = [*BAD_LINES.values(), json.dumps(TEXT_RECORD)]
    dataset = write_chats(tmp_path / "chats.jsonl", GOOD, bad)
    out = tmp_path / "out" / "regenerated.jsonl"
    job = regenerate(deployment, dataset, conversations_per_shard=2, then_extract=True, output_url=str(out))
    p = deployment.wait(job["job_id"])

    # Bad input: the extraction's rules and messages, and preformatted text, which has no turns to regenerate.
    expected_rejections = [
        {"line": item.line, "field": item.field, "reason": item.reason}
        for item in read_dataset(dataset.read_bytes().splitlines(keepends=True))
        if isinstance(item, InvalidRecord)
    ] + [
        {
            "line": len(GOOD) + len(bad),
            "field": "text",
            "reason": "preformatted text has no turns to regenerate (use messages)",
        }
    ]
    rejected = deployment.api.get(f"/v1/jobs/{job['job_id']}/rejected").json()
    assert [{k: r[k] for k in ("line", "field", "reason")} for r in rejected] == expected_rejections
    assert len(rejected) == len(bad) - 1  # "too-long" is only too long for length_policy "reject"

    # Every output line is one input conversation, in input order; the one with no room is recorded as failed.
    inputs = [c for c in read_dataset(dataset.read_text().splitlines()) if isinstance(c, Conversation)]
    accepted = [c for c in inputs if c.text is None]
    output = deployment.output(job["job_id"])
    assert [r["id"] for r in output] == [c.sample_id for c in accepted if c.sample_id != "no-room"]
    failed = deployment.api.get(f"/v1/jobs/{job['job_id']}/failed").json()
    assert [f["sample_id"] for f in failed] == ["no-room"]
    assert "leaves no room to generate within the server's max_context_length 1024" in failed[0]["reason"]
    assert (p.state, p.samples_done, p.samples_failed) == ("completed_with_errors", len(output), 1)

    by_id = {c.sample_id: c for c in accepted}
    for record in output:
        conversation = by_id[record["id"]]
        messages = record["messages"]
        assert [m["role"] for m in messages] == [m.role for m in conversation.messages]
        for message, original in zip(messages, conversation.messages, strict=True):
            if original.role != "assistant":
                assert message["content"] == original.content  # user and system turns unchanged
        # Assistant turns: the target's greedy decoding of the regenerated history, token for token.
        assert messages == greedy_regeneration(target, conversation), record["id"]

    # The server batched concurrent conversations into shared generate calls.
    metrics = httpx.get(f"{deployment.stack.env['EAGLE3_INFERENCE_URL']}/metrics").text
    decode = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in metrics.splitlines()
        if line.startswith("eagle3_inference_decode_batch_prompts_")
    }
    assert decode["eagle3_inference_decode_batch_prompts_sum"] > decode["eagle3_inference_decode_batch_prompts_count"]

    # Progress in generated tokens; the copy at output_url; the chained extraction takes the output as is.
    assert p.tokens_done == p.tokens_total > 0
    assert p.regeneration is not None and p.regeneration.turns_done == sum(
        m["role"] == "assistant" for r in output for m in r["messages"]
    )
    assert out.read_bytes() == deployment.storage.get(layout.regenerated_dataset(job["job_id"]))
    chained_id = p.regeneration.chained_job_id
    assert chained_id == f"{job['job_id']}-extract"
    extraction = deployment.wait(chained_id)
    assert (extraction.state, extraction.samples_total, extraction.samples_rejected) == ("completed", len(output), 0)
    body = deployment.api.get(f"/v1/jobs/{job['job_id']}").json()
    assert body["job"]["regeneration"]["chained_job_id"] == chained_id
    assert body["progress"]["regeneration"]["conversations_failed"] == 1

    # Resumed when done: nothing is run again.
    manifests = {k: deployment.storage.get(k) for k in deployment.storage.list(layout.manifests_prefix(job["job_id"]))}
    assert deployment.api.post(f"/v1/jobs/{job['job_id']}/resume").status_code == 200
    assert broker_drained(deployment.redis)  # resume enqueues before it answers: nothing was sent
    assert {k: deployment.storage.get(k) for k in manifests} == manifests
    assert progress.job_progress(deployment.redis, job["job_id"]).tokens_done == p.tokens_done


def test_dead_inference_server_dead_letters_then_resume_completes(deployment: Deployment, tmp_path: Path) -> None:
    dataset = write_chats(tmp_path / "chats.jsonl", GOOD[:3] + GOOD[4:6])
    inference = dict(deployment.stack.processes)["inference"]
    os.killpg(inference.pid, signal.SIGKILL)
    inference.wait()
    deployment.stack.processes = [(n, p) for n, p in deployment.stack.processes if n != "inference"]
    job = regenerate(deployment, dataset, conversations_per_shard=3)

    p = deployment.wait(job["job_id"])
    assert (p.state, p.shards_dead_lettered, p.samples_failed) == ("completed_with_errors", 2, 5)
    assert not deployment.storage.exists(layout.regenerated_dataset(job["job_id"]))  # held back, not partial
    failed = deployment.api.get(f"/v1/jobs/{job['job_id']}/failed").json()
    assert len(failed) == 5 and all("InferenceUnavailable" in f["reason"] for f in failed)

    deployment.stack.start_inference()
    assert deployment.api.post(f"/v1/jobs/{job['job_id']}/resume").status_code == 200
    p = deployment.wait(job["job_id"])
    assert (p.state, p.shards_dead_lettered, p.samples_failed, p.samples_done) == ("completed", 0, 0, 5)
    assert len(deployment.output(job["job_id"])) == 5

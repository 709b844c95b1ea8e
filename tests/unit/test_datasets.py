import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.data.datasets import Conversation, InvalidRecord, Message, iter_dataset_file, read_dataset
from shared.errors import InvalidSample

GOOD = json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]})


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        pytest.param(
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello!"},
                ]
            },
            [Message("system", "Be brief."), Message("user", "Hi"), Message("assistant", "Hello!")],
            id="openai",
        ),
        pytest.param(
            {
                "conversations": [
                    {"from": "system", "value": "Be brief."},
                    {"from": "human", "value": "Hi"},
                    {"from": "gpt", "value": "Hello!"},
                    {"from": "user", "value": "Bye"},
                    {"from": "assistant", "value": "Bye!"},
                ]
            },
            [
                Message("system", "Be brief."),
                Message("user", "Hi"),
                Message("assistant", "Hello!"),
                Message("user", "Bye"),
                Message("assistant", "Bye!"),
            ],
            id="sharegpt",
        ),
        pytest.param(
            {
                "id": "sf-1",
                "conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
            },
            [Message("user", "Hi"), Message("assistant", "Hello!")],
            id="specforge",
        ),
        pytest.param(
            {"messages": [{"role": "assistant", "content": ""}]},
            [Message("assistant", "")],
            id="empty-assistant-content",
        ),
    ],
)
def test_conversation_shapes_become_messages(record: dict, expected: list[Message]) -> None:
    (conv,) = read_dataset([json.dumps(record)])
    assert isinstance(conv, Conversation)
    assert conv.messages == expected
    assert conv.text is None and not conv.is_preformatted
    assert conv.line == 1


def test_preformatted_text_is_kept_verbatim() -> None:
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    (conv,) = read_dataset([json.dumps({"text": text})])
    assert isinstance(conv, Conversation)
    assert conv.is_preformatted and conv.text == text and conv.messages == []


@pytest.mark.parametrize(
    ("record_id", "expected"),
    [
        pytest.param("abc-1", "abc-1", id="string"),
        pytest.param(42, "42", id="int"),
        pytest.param(True, "line-1", id="bool-is-not-an-id"),
        pytest.param("", "line-1", id="empty-string"),
        pytest.param(1.5, "line-1", id="float"),
        pytest.param(None, "line-1", id="null"),
    ],
)
def test_sample_id_is_the_record_id_or_the_line(record_id: object, expected: str) -> None:
    record = json.loads(GOOD) | {"id": record_id}
    (conv,) = read_dataset([json.dumps(record)])
    assert isinstance(conv, Conversation)
    assert conv.sample_id == expected


def test_blank_lines_are_skipped_but_counted() -> None:
    results = list(read_dataset(["", GOOD, "   ", "\n", GOOD + "\n"]))
    assert [r.line for r in results if isinstance(r, Conversation)] == [2, 5]
    assert [r.sample_id for r in results if isinstance(r, Conversation)] == ["line-2", "line-5"]


def test_bytes_lines_and_byte_order_mark_are_accepted() -> None:
    (conv,) = read_dataset([b"\xef\xbb\xbf" + GOOD.encode() + b"\r\n"])
    assert isinstance(conv, Conversation)
    assert conv.messages[1] == Message("assistant", "Hello!")


def test_reading_is_lazy() -> None:
    def lines() -> Iterator[str]:
        yield GOOD
        raise AssertionError("read past the first record")

    assert isinstance(next(read_dataset(lines())), Conversation)


@pytest.mark.parametrize(
    ("line", "field", "reason"),
    [
        pytest.param('{"messages": [', "record", "malformed JSON", id="malformed-json"),
        pytest.param("[1, 2]", "record", "expected a JSON object, got array", id="not-an-object"),
        pytest.param('"just a string"', "record", "expected a JSON object, got string", id="json-string"),
        pytest.param('{"prompt": "Hi"}', "record", "unknown record shape", id="unknown-shape"),
        pytest.param('{"messages": []}', "messages", "empty conversation", id="empty-messages"),
        pytest.param('{"conversations": []}', "conversations", "empty conversation", id="empty-conversations"),
        pytest.param('{"messages": {"role": "user"}}', "messages", "expected an array", id="messages-not-array"),
        pytest.param('{"messages": ["Hi"]}', "messages[0]", "expected an object, got string", id="turn-not-object"),
        pytest.param(
            '{"messages": [{"role": "user", "content": "Hi"}]}', "messages", "no assistant turn", id="no-assistant"
        ),
        pytest.param(
            '{"conversations": [{"from": "human", "value": "Hi"}]}',
            "conversations",
            "no assistant turn",
            id="sharegpt-no-assistant",
        ),
        pytest.param(
            '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},'
            ' {"role": "robot", "content": "beep"}]}',
            "messages[2].role",
            "unknown role 'robot'",
            id="unknown-role",
        ),
        pytest.param(
            '{"messages": [{"role": "tool", "content": "{}"}, {"role": "assistant", "content": "Yo"}]}',
            "messages[0].role",
            "unknown role 'tool'",
            id="tool-role",
        ),
        pytest.param(
            '{"messages": [{"role": 3, "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}',
            "messages[0].role",
            "unknown role 3",
            id="non-string-role",
        ),
        pytest.param(
            '{"conversations": [{"from": "bot", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}',
            "conversations[0].from",
            "unknown role 'bot'",
            id="sharegpt-unknown-role",
        ),
        pytest.param(
            '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": 7}]}',
            "messages[1].content",
            "expected a string, got number",
            id="non-string-content",
        ),
        pytest.param(
            '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": null}]}',
            "messages[1].content",
            "expected a string, got null",
            id="null-content",
        ),
        pytest.param(
            '{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": ["Yo"]}]}',
            "conversations[1].value",
            "expected a string, got array",
            id="sharegpt-non-string-value",
        ),
        pytest.param(
            '{"messages": [{"role": "user", "content": "Hi"}, {"content": "Yo"}]}',
            "messages[1].role",
            "missing key 'role'",
            id="missing-role",
        ),
        pytest.param(
            '{"messages": [{"role": "user"}, {"role": "assistant", "content": "Yo"}]}',
            "messages[0].content",
            "missing key 'content'",
            id="missing-content",
        ),
        pytest.param(
            '{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt"}]}',
            "conversations[1].value",
            "missing key 'value'",
            id="sharegpt-missing-value",
        ),
        pytest.param(
            '{"id": 1, "conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant"}]}',
            "conversations[1].content",
            "missing key 'content'",
            id="specforge-missing-content",
        ),
        pytest.param('{"text": 5}', "text", "expected a string, got number", id="non-string-text"),
        pytest.param('{"text": "  "}', "text", "empty text", id="empty-text"),
    ],
)
def test_rejections_name_line_field_and_reason(line: str, field: str, reason: str) -> None:
    # A good record and a blank line before the bad one: the line number must count both.
    results = list(read_dataset([GOOD, "", line, GOOD]))
    assert [type(r) for r in results] == [Conversation, InvalidRecord, Conversation]
    rejected = results[1]
    assert isinstance(rejected, InvalidSample)
    assert rejected.line == 3
    assert rejected.field == field
    assert reason in rejected.reason
    has_id = '"id": 1' in line
    assert rejected.sample_id == ("1" if has_id else "line-3")
    prefix = "sample 1 (line 3)" if has_id else "sample line-3"
    assert str(rejected).startswith(f"{prefix}: {field}: ")


def test_rejection_message_matches_the_documented_form() -> None:
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "robot"}]}
    bad["messages"][2]["content"] = "beep"
    lines = [GOOD] * 6 + [json.dumps(bad)]
    rejected = list(read_dataset(lines))[-1]
    assert str(rejected).startswith("sample line-7: messages[2].role: unknown role 'robot'")


def test_rejection_of_a_record_with_an_id_still_names_its_line() -> None:
    bad = json.dumps({"id": "conv-9", "messages": [{"role": "user", "content": "Hi"}]})
    (rejected,) = read_dataset(["", bad])
    assert isinstance(rejected, InvalidRecord)
    assert rejected.sample_id == "conv-9"
    assert str(rejected) == "sample conv-9 (line 2): messages: no assistant turn: nothing to train on"


def test_invalid_utf8_is_rejected_with_its_line() -> None:
    (good, rejected) = read_dataset([GOOD.encode(), b'{"text": "\xff"}'])
    assert isinstance(good, Conversation)
    assert isinstance(rejected, InvalidRecord)
    assert (rejected.line, rejected.field) == (2, "record")
    assert "not valid UTF-8" in rejected.reason


def test_iter_dataset_file_streams_a_file(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(GOOD + "\n\nnot json\n" + json.dumps({"id": "t", "text": "plain"}) + "\n", encoding="utf-8")
    results = list(iter_dataset_file(path))
    assert [type(r) for r in results] == [Conversation, InvalidRecord, Conversation]
    assert [r.line for r in results] == [1, 3, 4]  # type: ignore[union-attr]
    assert results[2].sample_id == "t"

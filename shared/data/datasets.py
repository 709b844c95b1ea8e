"""Read chat datasets from JSONL, one record per line, into `Conversation`s.

Accepted record shapes (checked in this order, so a record carrying several keys takes the first):
  OpenAI       {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
  ShareGPT     {"conversations": [{"from": "system"|"human"|"gpt"|"user"|"assistant", "value": str}, ...]}
  SpecForge    {"id": ..., "conversations": [{"role": ..., "content": ...}, ...]}
  preformatted {"text": str}   (already rendered with the chat template; trained on every token)

A bad record never stops the stream: it comes out in its place as an `InvalidRecord`, an `InvalidSample`
that also carries the line number, so that the producer can record every rejection with its reason.
"""

import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from shared.errors import InvalidSample

logger = logging.getLogger(__name__)

Role = Literal["system", "user", "assistant"]

# ShareGPT's speaker names, plus the OpenAI names that some ShareGPT exports use.
_SHAREGPT_ROLES: dict[str, Role] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
_OPENAI_ROLES: dict[str, Role] = {"system": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True, slots=True)
class Message:
    role: Role
    content: str


@dataclass(frozen=True, slots=True)
class Conversation:
    """One dataset record: either `messages` (to be rendered with the chat template) or preformatted `text`."""

    sample_id: str  # the record's own "id" when it has a string or int one, else "line-{line}"
    line: int  # 1-based line in the dataset file
    messages: list[Message] = field(default_factory=list)
    text: str | None = None

    @property
    def is_preformatted(self) -> bool:
        return self.text is not None


class InvalidRecord(InvalidSample):
    """An `InvalidSample` that knows its dataset line, so the message can always point at it."""

    def __init__(self, sample_id: str, line: int, field: str, reason: str) -> None:
        super().__init__(sample_id, field, reason)
        self.line = line
        if sample_id != _line_id(line):
            # The record's own id alone would not tell a user where to look in the file.
            self.args = (f"sample {sample_id} (line {line}): {field}: {reason}",)


def read_dataset(lines: Iterable[str | bytes]) -> Iterator[Conversation | InvalidRecord]:
    """Parse JSONL lines lazily: one `Conversation` or `InvalidRecord` per non-blank line, in order."""
    for line_no, raw in enumerate(lines, start=1):
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield InvalidRecord(_line_id(line_no), line_no, "record", f"not valid UTF-8: {exc}")
                continue
        if line_no == 1:
            raw = raw.removeprefix("\ufeff")  # a byte-order mark that editors on Windows like to add
        if not raw.strip():
            continue
        try:
            yield _parse_line(raw, line_no)
        except InvalidRecord as exc:
            yield exc


def iter_dataset_file(path: Path) -> Iterator[Conversation | InvalidRecord]:
    """`read_dataset` over a file, streamed (the file stays open until the iterator is exhausted or closed)."""
    with path.open("rb") as lines:
        yield from read_dataset(lines)


def write_dataset_file(path: Path, records: Iterable[dict[str, Any]]) -> Path:
    """JSONL, one record a line, written whole or not at all: readers never see a half-written dataset."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp")
    with partial.open("w", encoding="utf-8", newline="\n") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(partial, path)
    return path


def _line_id(line: int) -> str:
    return f"line-{line}"


def _type_name(value: object) -> str:
    # JSON's names, not Python's: the user wrote JSON.
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__
    )


def _parse_line(raw: str, line: int) -> Conversation:
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRecord(_line_id(line), line, "record", f"malformed JSON: {exc}") from None
    if not isinstance(record, dict):
        raise InvalidRecord(_line_id(line), line, "record", f"expected a JSON object, got {_type_name(record)}")

    record_id = record.get("id")
    # bool is an int in Python but not an id anyone meant; an empty string identifies nothing.
    has_id = isinstance(record_id, (str, int)) and not isinstance(record_id, bool) and str(record_id) != ""
    sample_id = str(record_id) if has_id else _line_id(line)

    if "messages" in record:
        messages = _parse_turns(record["messages"], "messages", ("role", "content"), _OPENAI_ROLES, sample_id, line)
        return Conversation(sample_id=sample_id, line=line, messages=messages)
    if "conversations" in record:
        turns = record["conversations"]
        # ShareGPT says from/value, SpecForge says role/content under the same key; the first turn decides.
        first = turns[0] if isinstance(turns, list) and turns else None
        if isinstance(first, dict) and "from" in first:
            keys, roles = ("from", "value"), _SHAREGPT_ROLES
        else:
            keys, roles = ("role", "content"), _OPENAI_ROLES
        messages = _parse_turns(turns, "conversations", keys, roles, sample_id, line)
        return Conversation(sample_id=sample_id, line=line, messages=messages)
    if "text" in record:
        text = record["text"]
        if not isinstance(text, str):
            raise InvalidRecord(sample_id, line, "text", f"expected a string, got {_type_name(text)}")
        if not text.strip():
            raise InvalidRecord(sample_id, line, "text", "empty text")
        return Conversation(sample_id=sample_id, line=line, text=text)
    raise InvalidRecord(
        sample_id,
        line,
        "record",
        f"unknown record shape: expected a 'messages', 'conversations' or 'text' key, got keys {sorted(record)}",
    )


def _parse_turns(
    turns: Any,
    key: str,
    fields: tuple[str, str],
    roles: dict[str, Role],
    sample_id: str,
    line: int,
) -> list[Message]:
    role_key, content_key = fields
    if not isinstance(turns, list):
        raise InvalidRecord(sample_id, line, key, f"expected an array of turns, got {_type_name(turns)}")
    if not turns:
        raise InvalidRecord(sample_id, line, key, "empty conversation")
    messages = []
    for index, turn in enumerate(turns):
        where = f"{key}[{index}]"
        if not isinstance(turn, dict):
            raise InvalidRecord(sample_id, line, where, f"expected an object, got {_type_name(turn)}")
        for required in fields:
            if required not in turn:
                raise InvalidRecord(sample_id, line, f"{where}.{required}", f"missing key '{required}'")
        role, content = turn[role_key], turn[content_key]
        if not isinstance(role, str) or role not in roles:
            raise InvalidRecord(
                sample_id, line, f"{where}.{role_key}", f"unknown role {role!r} (expected one of {sorted(roles)})"
            )
        if not isinstance(content, str):
            raise InvalidRecord(
                sample_id, line, f"{where}.{content_key}", f"expected a string, got {_type_name(content)}"
            )
        messages.append(Message(role=roles[role], content=content))
    if not any(message.role == "assistant" for message in messages):
        raise InvalidRecord(sample_id, line, key, "no assistant turn: nothing to train on")
    return messages

"""Small JSONL datasets for tests: every record shape, and every kind of bad line."""

import json
from pathlib import Path

GOOD_RECORDS: list[dict] = [
    {
        "messages": [
            {"role": "user", "content": "Hello, how are you doing today?"},
            {"role": "assistant", "content": "I am fine, thank you. What about you?"},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."},
            {"role": "user", "content": "And the boiling point of water?"},
            {"role": "assistant", "content": "Water boils at one hundred degrees Celsius at sea level."},
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "Can you tell me a joke about computers?"},
            {"from": "gpt", "value": "Artificial intelligence is the branch of engineering."},
        ]
    },
    {
        "id": "specforge-1",
        "conversations": [
            {"role": "user", "content": "Numbers like 2024?"},
            {"role": "assistant", "content": "They are split into digits."},
        ],
    },
    {"text": "The capital of France is Paris. Hello, how are you doing today?"},
] + [
    {
        "messages": [
            {"role": "user", "content": f"Question {i}: how are you doing today?"},
            {"role": "assistant", "content": "I am fine, thank you. " * (1 + i % 4)},
        ]
    }
    for i in range(12)
]

BAD_LINES: dict[str, str] = {
    "malformed-json": '{"messages": [',
    "unknown-shape": json.dumps({"prompt": "hi", "completion": "there"}),
    "empty-conversation": json.dumps({"messages": []}),
    "no-assistant-turn": json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
    "unknown-role": json.dumps(
        {"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "x"}]}
    ),
    "non-string-content": json.dumps(
        {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}
    ),
    "too-long": json.dumps(
        {
            "messages": [
                {"role": "user", "content": "Hello, how are you doing today? " * 80},
                {"role": "assistant", "content": "Fine."},
            ]
        }
    ),
}


def write_dataset(path: Path, *, with_bad_lines: bool = True, repeat: int = 1) -> tuple[Path, dict[str, int]]:
    """Write the records (bad lines interleaved); return the path and the line number of each bad line."""
    lines: list[str] = []
    bad_at: dict[str, int] = {}
    bad = list(BAD_LINES.items()) if with_bad_lines else []
    for r in range(repeat):
        for i, record in enumerate(GOOD_RECORDS):
            lines.append(json.dumps(record))
            if r == 0 and i < len(bad):
                name, line = bad[i]
                lines.append(line)
                bad_at[name] = len(lines)
    path.write_text("\n".join(lines) + "\n")
    return path, bad_at

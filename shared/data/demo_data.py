"""A small offline chat dataset for demos and tests, built from two data wheels.

chatterbot-corpus (BSD) gives short question -> answer dialogs; chitchat-dataset (MIT) gives long casual
human-human chats. Half of the output comes from each, picked and shuffled by a seeded RNG, written as
OpenAI `messages` JSONL with an `id` naming the source. Turns alternate user/assistant starting with
the user, runs of whitespace and blank lines are collapsed, and long chats are cut at a whole
assistant turn so that every conversation stays under about 400 SmolLM2 tokens, default system
prompt included.
"""

import logging
import random
from pathlib import Path

from shared.data.chat_corpora import Dialog, chatterbot_dialogs, chitchat_dialogs, clean_turn
from shared.data.datasets import write_dataset_file
from shared.errors import ConfigurationError

logger = logging.getLogger(__name__)

# ~4 characters per token for English, plus ~5 template tokens per turn and ~20 for SmolLM2's default
# system prompt: 8 turns of at most 1,000 characters in all stay below 400 tokens.
MAX_TURNS = 8
MAX_CHARS = 1000


def write_demo_dataset(out_path: Path, *, num_conversations: int = 200, seed: int = 0) -> Path:
    """Write `num_conversations` conversations to `out_path` (JSONL); the same seed gives the same bytes."""
    if num_conversations < 1:
        raise ConfigurationError(f"num_conversations={num_conversations}: must be at least 1")
    rng = random.Random(seed)
    chatterbot = _usable(chatterbot_dialogs())
    chitchat = _usable(chitchat_dialogs())
    num_chatterbot = num_conversations // 2
    num_chitchat = num_conversations - num_chatterbot
    if num_chatterbot > len(chatterbot) or num_chitchat > len(chitchat):
        raise ConfigurationError(
            f"num_conversations={num_conversations}: only {len(chatterbot)} chatterbot and {len(chitchat)} "
            "chitchat conversations are usable"
        )
    picked = rng.sample(chatterbot, num_chatterbot) + rng.sample(chitchat, num_chitchat)
    rng.shuffle(picked)

    write_dataset_file(out_path, ({"id": dialog_id, "messages": messages} for dialog_id, messages in picked))
    logger.info("wrote %d demo conversations (seed %d) to %s", len(picked), seed, out_path)
    return out_path


def _usable(dialogs: list[Dialog]) -> list[tuple[str, list[dict[str, str]]]]:
    """Cleaned and capped `messages` lists; dialogs without one whole user -> assistant exchange are dropped."""
    usable = []
    for dialog_id, turns in dialogs:
        kept: list[str] = []
        num_chars = 0
        for turn in turns:
            text = clean_turn(turn)
            if not text or len(kept) == MAX_TURNS or num_chars + len(text) > MAX_CHARS:
                break
            kept.append(text)
            num_chars += len(text)
        del kept[len(kept) - len(kept) % 2 :]  # end on an assistant turn
        if kept:
            roles = ("user", "assistant")
            usable.append((dialog_id, [{"role": roles[i % 2], "content": text} for i, text in enumerate(kept)]))
    return usable

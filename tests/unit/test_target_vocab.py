"""A target whose embedding has more rows than its tokenizer has tokens (vocabularies padded to a multiple, as many
released models are): a job is planned for the model's vocabulary, which is what an inference server reports and
what the drafter's t2d has one entry per."""

import json
import shutil
from pathlib import Path

from shared.data.datasets import Conversation, Message
from shared.data.tokenization import ChatTokenizer
from shared.data.vocab import load_vocab_mapping
from shared.lifecycle.kind import Target
from shared.lifecycle.kinds.extract import Extract
from shared.lifecycle.schemas import JobSpec


def padded_copy(model_dir: Path, out: Path, rows: int) -> Path:
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["vocab_size"] = rows
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_an_extraction_is_planned_for_the_models_vocabulary_not_the_tokenizers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tokenizer = ChatTokenizer.from_pretrained(tiny_model_dir)
    rows = 4 * tokenizer.vocab_size  # well past the tokenizer's own count
    model_dir = padded_copy(tiny_model_dir, tmp_path / "padded", rows)
    target = Target.load(model_dir, ChatTokenizer.from_pretrained(model_dir), None)
    kind, spec = Extract(), JobSpec(dataset_url="-", draft_vocab_size=64)
    conversation = Conversation(
        sample_id="s0",
        line=1,
        messages=[Message(role="user", content="Hello there"), Message(role="assistant", content="Hi! How are you?")],
    )
    plan = kind.plan("job-padded", spec, target, [kind.accept(conversation, spec, target)])

    assert target.record().vocab_size == rows
    (mapping_bytes,) = plan.files.values()
    mapping = load_vocab_mapping(mapping_bytes)
    assert mapping.t2d.numel() == rows
    assert mapping.draft_vocab_size == 64

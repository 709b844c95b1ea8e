import hashlib
import shutil
from pathlib import Path

import pytest

from shared.data.datasets import Conversation, Message
from shared.data.tokenization import ChatTokenizer, TokenizedSample
from shared.errors import ConfigurationError, InvalidSample
from tests.builders import CHATML_TEMPLATE


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(tiny_model_dir)


def conversation(*turns: tuple[str, str], sample_id: str = "s-1", line: int = 5) -> Conversation:
    return Conversation(sample_id=sample_id, line=line, messages=[Message(role, content) for role, content in turns])


def masked_text(chat_tokenizer: ChatTokenizer, sample: TokenizedSample, value: int = 1) -> str:
    """Decode exactly the tokens whose loss_mask equals `value`, concatenated."""
    ids = [token for token, masked in zip(sample.input_ids, sample.loss_mask, strict=True) if masked == value]
    return chat_tokenizer.tokenizer.decode(ids)


def test_single_turn_masks_the_assistant_content_and_its_end_token(chat_tokenizer: ChatTokenizer) -> None:
    conv = conversation(("system", "Be nice."), ("user", "Hello, how are you?"), ("assistant", "I am fine, thank you."))
    sample = chat_tokenizer.tokenize(conv, max_length=1024, length_policy="truncate")
    assert masked_text(chat_tokenizer, sample) == "I am fine, thank you.<|im_end|>"
    assert masked_text(chat_tokenizer, sample, value=0) == (
        "<|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\nHello, how are you?<|im_end|>\n"
        "<|im_start|>assistant\n\n"
    )
    assert (sample.sample_id, sample.line, sample.truncated) == ("s-1", 5, False)
    assert sample.num_tokens == sample.original_num_tokens == len(sample.input_ids) == len(sample.loss_mask)


def test_input_ids_are_the_template_rendering_tokenized_once(chat_tokenizer: ChatTokenizer) -> None:
    conv = conversation(("user", "Hi"), ("assistant", "Hello"))
    sample = chat_tokenizer.tokenize(conv, max_length=1024, length_policy="truncate")
    rendered = chat_tokenizer.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], tokenize=False
    )
    assert sample.input_ids == chat_tokenizer.tokenizer(rendered, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "turns",
    [
        pytest.param(
            [
                ("system", "You are a helpful assistant."),
                ("user", "What is the capital of France?"),
                ("assistant", "The capital of France is Paris."),
                ("user", "And water?"),
                ("assistant", "Water boils at one hundred degrees Celsius at sea level."),
                ("user", "Numbers like 2024?"),
                ("assistant", "Numbers like 2024 and 12345 are split into digits."),
            ],
            id="three-assistant-turns",
        ),
        pytest.param(
            [("user", "Hello"), ("assistant", "Hello"), ("user", "Hello"), ("assistant", "Hello")],
            id="assistant-repeats-user-text",
        ),
        pytest.param(
            [("system", "assistant\nYes"), ("user", "Yes"), ("assistant", "Yes")],
            id="assistant-text-appears-earlier",
        ),
        pytest.param([("assistant", "I speak first.")], id="assistant-first"),
        pytest.param([("user", "Say nothing."), ("assistant", "")], id="empty-assistant-content"),
        pytest.param(
            [("user", "Emoji?"), ("assistant", "Sure 😀 ünïcode\n\n  with spaces  ")], id="unicode-and-whitespace"
        ),
        pytest.param(
            [("user", "a"), ("user", "b"), ("assistant", "c"), ("assistant", "d")],
            id="consecutive-same-role",
        ),
    ],
)
def test_mask_decodes_to_exactly_the_assistant_turns(
    chat_tokenizer: ChatTokenizer, turns: list[tuple[str, str]]
) -> None:
    sample = chat_tokenizer.tokenize(conversation(*turns), max_length=1024, length_policy="truncate")
    assistant = "".join(content + "<|im_end|>" for role, content in turns if role == "assistant")
    everything_else = "".join(
        f"<|im_start|>{role}\n" + ("" if role == "assistant" else content + "<|im_end|>") + "\n"
        for role, content in turns
    )
    assert masked_text(chat_tokenizer, sample) == assistant
    assert masked_text(chat_tokenizer, sample, value=0) == everything_else


def test_truncate_keeps_the_prefix_and_records_the_original_length(chat_tokenizer: ChatTokenizer) -> None:
    conv = conversation(("user", "Hi"), ("assistant", "Hello, how are you doing today?"), ("user", "Fine"))
    full = chat_tokenizer.tokenize(conv, max_length=1024, length_policy="truncate")
    max_length = full.num_tokens - 5
    cut = chat_tokenizer.tokenize(conv, max_length=max_length, length_policy="truncate")
    assert cut.truncated and cut.num_tokens == max_length == len(cut.input_ids) == len(cut.loss_mask)
    assert cut.original_num_tokens == full.num_tokens
    assert cut.input_ids == full.input_ids[:max_length]
    assert cut.loss_mask == full.loss_mask[:max_length]


def test_reject_policy_names_both_lengths(chat_tokenizer: ChatTokenizer) -> None:
    conv = conversation(("user", "Hi"), ("assistant", "Hello, how are you doing today?"))
    num_tokens = chat_tokenizer.tokenize(conv, max_length=1024, length_policy="reject").num_tokens
    with pytest.raises(InvalidSample) as excinfo:
        chat_tokenizer.tokenize(conv, max_length=num_tokens - 1, length_policy="reject")
    assert excinfo.value.sample_id == "s-1" and excinfo.value.field == "input_ids"
    assert str(num_tokens) in excinfo.value.reason and str(num_tokens - 1) in excinfo.value.reason
    assert "line 5" in str(excinfo.value)


def test_sample_within_max_length_is_not_truncated(chat_tokenizer: ChatTokenizer) -> None:
    conv = conversation(("user", "Hi"), ("assistant", "Hello"))
    num_tokens = chat_tokenizer.tokenize(conv, max_length=1024, length_policy="reject").num_tokens
    sample = chat_tokenizer.tokenize(conv, max_length=num_tokens, length_policy="reject")
    assert not sample.truncated and sample.num_tokens == num_tokens


def test_truncation_that_leaves_no_assistant_token_is_rejected(chat_tokenizer: ChatTokenizer) -> None:
    conv = conversation(("user", "Hello, how are you doing today?"), ("assistant", "Fine."))
    with pytest.raises(InvalidSample) as excinfo:
        chat_tokenizer.tokenize(conv, max_length=8, length_policy="truncate")
    assert excinfo.value.field == "loss_mask"
    assert "no assistant token" in excinfo.value.reason and "first 8" in excinfo.value.reason


def test_preformatted_text_is_tokenized_as_is_and_fully_trained(chat_tokenizer: ChatTokenizer) -> None:
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    sample = chat_tokenizer.tokenize(Conversation("p", 1, text=text), max_length=1024, length_policy="reject")
    assert sample.input_ids == chat_tokenizer.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert chat_tokenizer.tokenizer.decode(sample.input_ids) == text
    assert sample.loss_mask == [1] * sample.num_tokens


def test_preformatted_text_truncates_too(chat_tokenizer: ChatTokenizer) -> None:
    sample = chat_tokenizer.tokenize(
        Conversation("p", 1, text="Hello, how are you doing today?"), max_length=3, length_policy="truncate"
    )
    assert sample.truncated and sample.num_tokens == 3 and sample.original_num_tokens > 3


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        pytest.param(
            # Llama-3 style: trimmed content, a double newline after the header, no newline between turns.
            "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '<pad>\n\n' + m['content'] | trim"
            " + '<|im_end|>' }}{% endfor %}",
            "Hello there.<|im_end|>",
            id="trimming-template",
        ),
        pytest.param(
            # SmolLM2 style: a default system prompt that mentions the assistant's answer.
            "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
            "{{ '<|im_start|>system\nSay Hello there. always<|im_end|>\n' }}{% endif %}"
            "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}",
            "  Hello there.  <|im_end|>",
            id="default-system-prompt",
        ),
        pytest.param(
            # Mistral/Llama-2 style: whitespace between content and the closing special token.
            "{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
            "{% else %}{{ m['content'] + ' <|endoftext|>' }}{% endif %}{% endfor %}",
            "  Hello there.   <|endoftext|>",
            id="space-before-end-token",
        ),
        pytest.param(
            # No special token closes a turn: only the content is trained.
            "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}",
            "  Hello there.  ",
            id="no-end-token",
        ),
    ],
)
def test_mask_follows_other_template_styles(chat_tokenizer: ChatTokenizer, template: str, expected: str) -> None:
    custom = ChatTokenizer(chat_tokenizer.tokenizer, template)
    conv = conversation(("user", "Hi"), ("assistant", "  Hello there.  "))
    sample = custom.tokenize(conv, max_length=1024, length_policy="reject")
    assert masked_text(custom, sample) == expected


def test_template_that_rewrites_content_is_refused(chat_tokenizer: ChatTokenizer) -> None:
    custom = ChatTokenizer(
        chat_tokenizer.tokenizer,
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | upper + '<|im_end|>' }}"
        "{% endfor %}",
    )
    with pytest.raises(InvalidSample) as excinfo:
        custom.tokenize(conversation(("user", "Hi"), ("assistant", "hello")), max_length=64, length_policy="reject")
    assert excinfo.value.field == "messages[1].content"


def test_template_exception_becomes_invalid_sample(chat_tokenizer: ChatTokenizer) -> None:
    custom = ChatTokenizer(
        chat_tokenizer.tokenizer,
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('must start with user') }}{% endif %}"
        + CHATML_TEMPLATE,
    )
    with pytest.raises(InvalidSample) as excinfo:
        custom.tokenize(conversation(("assistant", "hello")), max_length=64, length_policy="reject")
    assert excinfo.value.field == "messages" and "must start with user" in excinfo.value.reason


def test_template_hash_and_vocab_size(chat_tokenizer: ChatTokenizer) -> None:
    assert chat_tokenizer.template_hash == hashlib.sha256(CHATML_TEMPLATE.encode()).hexdigest()
    assert chat_tokenizer.vocab_size == len(chat_tokenizer.tokenizer)


@pytest.mark.parametrize(
    ("max_length", "policy"),
    [pytest.param(0, "truncate", id="zero-length"), pytest.param(16, "drop", id="unknown-policy")],
)
def test_bad_length_settings_are_configuration_errors(
    chat_tokenizer: ChatTokenizer, max_length: int, policy: str
) -> None:
    with pytest.raises(ConfigurationError):
        chat_tokenizer.tokenize(conversation(("assistant", "x")), max_length=max_length, length_policy=policy)  # type: ignore[arg-type]


def test_missing_folder_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="does not exist"):
        ChatTokenizer.from_pretrained(tmp_path / "nope")


def test_tokenizer_without_chat_template_is_a_configuration_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny_model_dir, tmp_path / "no-template")
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ConfigurationError, match="no chat template"):
        ChatTokenizer.from_pretrained(folder)

"""Chat template -> `input_ids` and the assistant-only `loss_mask`.

A conversation is rendered once with the tokenizer's own chat template and the rendered text is
tokenized once (no added special tokens: the template writes them), so the ids are exactly what the
target model sees when it serves the same conversation.

How the loss mask is found, and what it assumes of a template:
  1. Each assistant message's content is located in the rendered text by rendering the conversation
     again with that content replaced by a sentinel. The text before the sentinel must equal the text
     before the content in the real rendering, so the position is exact even where the template adds
     text of its own around messages (a default system prompt, role headers, dates). A template may
     trim the content (Llama 3 does `| trim`); one that rewrites it in any other way is refused.
  2. Character spans become token spans through the tokenizer's offsets (a fast tokenizer is
     required). A token that straddles the edge of the content counts as content.
  3. The turn's end is trained too, because the drafter must learn to predict it: after the content,
     any whitespace-only tokens and then the first special token (`<|im_end|>`, `<|eot_id|>`,
     `<end_of_turn>`, `</s>`). Text after that special token (ChatML's newline) is not trained. If
     anything but whitespace comes before a special token, the template has no end-of-turn token
     and only the content is masked.
"""

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from jinja2.exceptions import TemplateError

from shared.data.datasets import Conversation, InvalidRecord, Message
from shared.errors import ConfigurationError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

LengthPolicy = Literal["truncate", "reject"]

# Stands in for one assistant content while locating it; no templates transform plain ASCII letters.
_SENTINEL = "EAGLE3xASSISTANTxCONTENTxSENTINEL"


@dataclass(frozen=True, slots=True)
class TokenizedSample:
    sample_id: str
    line: int
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant content and its end-of-turn token, 0 elsewhere
    num_tokens: int  # len(input_ids), after truncation
    original_num_tokens: int  # before truncation
    truncated: bool

    def __post_init__(self) -> None:
        assert len(self.input_ids) == len(self.loss_mask) == self.num_tokens, (
            len(self.input_ids),
            len(self.loss_mask),
            self.num_tokens,
        )


class ChatTokenizer:
    """A Hugging Face fast tokenizer plus its chat template, producing training samples."""

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", chat_template: str) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        # Every id that closes a turn in some template is a special added token; plain text never is.
        self._special_ids = set(tokenizer.all_special_ids) | {
            token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special
        }

    @classmethod
    def from_pretrained(cls, model_path: Path | str) -> "ChatTokenizer":
        from transformers import AutoTokenizer

        path = Path(model_path)
        if not path.is_dir():
            raise ConfigurationError(f"tokenizer folder {path} does not exist")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigurationError(f"tokenizer folder {path}: cannot load a tokenizer: {exc}") from exc
        if not tokenizer.is_fast:
            raise ConfigurationError(
                f"tokenizer folder {path}: {type(tokenizer).__name__} is not a fast tokenizer; "
                "the loss mask needs character offsets (tokenizer.json)"
            )
        template = tokenizer.chat_template
        if isinstance(template, dict):  # several named templates: the unnamed one is "default"
            template = template.get("default")
        if not isinstance(template, str) or not template.strip():
            raise ConfigurationError(
                f"tokenizer folder {path}: no chat template (chat_template.jinja or tokenizer_config.json)"
            )
        return cls(tokenizer, template)

    @property
    def template_hash(self) -> str:
        """sha256 of the chat template: two jobs with equal hashes rendered conversations the same way."""
        return hashlib.sha256(self.chat_template.encode("utf-8")).hexdigest()

    @property
    def vocab_size(self) -> int:
        """Number of token ids including added tokens, which can exceed the model's embedding rows."""
        return len(self.tokenizer)

    def tokenize(self, conv: Conversation, *, max_length: int, length_policy: LengthPolicy) -> TokenizedSample:
        """Raises `InvalidSample` (an `InvalidRecord`, with the line) for a sample that cannot be trained on."""
        if max_length < 1:
            raise ConfigurationError(f"max_length={max_length}: must be at least 1")
        if length_policy not in ("truncate", "reject"):
            raise ConfigurationError(f"length_policy={length_policy!r}: expected 'truncate' or 'reject'")

        if conv.text is not None:
            # Preformatted text already carries its template's special tokens; every token is trained.
            input_ids = self.tokenizer(conv.text, add_special_tokens=False)["input_ids"]
            loss_mask = [1] * len(input_ids)
        else:
            input_ids, loss_mask = self._tokenize_messages(conv)

        original_num_tokens = len(input_ids)
        truncated = original_num_tokens > max_length
        if truncated:
            if length_policy == "reject":
                raise InvalidRecord(
                    conv.sample_id,
                    conv.line,
                    "input_ids",
                    f"{original_num_tokens} tokens exceed max_length={max_length}",
                )
            input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
        if not any(loss_mask):
            where = f"in the first {max_length} of {original_num_tokens} tokens" if truncated else "at all"
            raise InvalidRecord(conv.sample_id, conv.line, "loss_mask", f"no assistant token to train on {where}")
        return TokenizedSample(
            sample_id=conv.sample_id,
            line=conv.line,
            input_ids=input_ids,
            loss_mask=loss_mask,
            num_tokens=len(input_ids),
            original_num_tokens=original_num_tokens,
            truncated=truncated,
        )

    def generation_prompt(self, conv: Conversation, messages: Sequence[Message]) -> list[int]:
        """Token ids of `messages` rendered with the chat template plus the assistant's generation prompt: what the
        target reads before it writes the next assistant turn (regeneration). Rendered once, tokenized once, like
        `tokenize`, so the prompt is exactly the prefix of the conversation that extraction will see."""
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": message.role, "content": message.content} for message in messages],
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=True,
            )
        except TemplateError as exc:
            raise InvalidRecord(conv.sample_id, conv.line, "messages", f"chat template refused it: {exc}") from exc
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _render(self, conv: Conversation, messages: Sequence[Message]) -> str:
        try:
            # With tokenize=False the template's text; transformers types every form the call can return.
            rendered = self.tokenizer.apply_chat_template(
                [{"role": message.role, "content": message.content} for message in messages],
                chat_template=self.chat_template,
                tokenize=False,
            )
            return cast(str, rendered)
        except TemplateError as exc:  # e.g. "Conversation roles must alternate user/assistant"
            raise InvalidRecord(conv.sample_id, conv.line, "messages", f"chat template refused it: {exc}") from exc

    def _assistant_spans(self, conv: Conversation, text: str) -> list[tuple[int, int]]:
        """Character spans [start, end) of each assistant content in `text`, the full rendering."""
        spans = []
        for index, message in enumerate(conv.messages):
            if message.role != "assistant":
                continue
            probe = list(conv.messages)
            probe[index] = Message(role="assistant", content=_SENTINEL)
            probe_text = self._render(conv, probe)
            start = probe_text.find(_SENTINEL)
            field = f"messages[{index}].content"
            if start < 0 or probe_text.count(_SENTINEL) != 1 or probe_text[:start] != text[:start]:
                raise InvalidRecord(
                    conv.sample_id, conv.line, field, "chat template does not render this turn at a stable position"
                )
            content = message.content if text.startswith(message.content, start) else message.content.strip()
            if not text.startswith(content, start):
                raise InvalidRecord(conv.sample_id, conv.line, field, "chat template rewrites the assistant content")
            spans.append((start, start + len(content)))
        return spans

    def _tokenize_messages(self, conv: Conversation) -> tuple[list[int], list[int]]:
        text = self._render(conv, conv.messages)
        spans = self._assistant_spans(conv, text)
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        input_ids: list[int] = encoding["input_ids"]
        offsets: list[tuple[int, int]] = encoding["offset_mapping"]
        num_tokens = len(input_ids)
        loss_mask = [0] * num_tokens

        token = 0  # spans come in order, so one forward walk over the tokens serves them all
        for start, end in spans:
            while token < num_tokens and offsets[token][1] <= start:
                token += 1
            # Content: every token overlapping [start, end).
            while token < num_tokens and offsets[token][0] < end:
                loss_mask[token] = 1
                token += 1
            # End of turn: whitespace-only tokens, then the first special token, inclusive.
            close = token
            while (
                close < num_tokens
                and input_ids[close] not in self._special_ids
                and text[offsets[close][0] : offsets[close][1]].isspace()
            ):
                close += 1
            if close < num_tokens and input_ids[close] in self._special_ids:
                loss_mask[token : close + 1] = [1] * (close + 1 - token)
                token = close + 1
            else:
                logger.debug("sample %s: no end-of-turn token after assistant content at char %d", conv.sample_id, end)
        return input_ids, loss_mask

"""The AST check of what the plugin needs from SGLang's source."""

import ast
import os
from pathlib import Path

import pytest
from eagle3_sglang_plugin.contract import CONTRACT, Fields, Signature, _check_callable, _check_fields, check


def test_an_empty_tree_breaks_every_entry_and_every_flag(tmp_path: Path) -> None:
    problems = check(tmp_path)

    assert len([p for p in problems if p.endswith(": missing")]) == len(CONTRACT)
    assert any("--return-aux-hidden-state-layer-ids" in p for p in problems)
    assert any("--chunked-prefill-size" in p for p in problems)


SOURCE = """
class SchedulerBatchResultProcessor:
    def _append_prefill_hidden_states(self, *, req, logits_output, hidden_state_offset, store=True):
        pass

class LogitsProcessorOutput:
    hidden_states: object = None

    def __init__(self):
        self.next_token_logits = None
"""


def test_a_moved_parameter_is_reported() -> None:
    entry = Signature(
        "x.py", "SchedulerBatchResultProcessor._append_prefill_hidden_states", ("self",), ("req", "extend_input_len")
    )

    assert _check_callable(ast.parse(SOURCE), entry) == [
        "x.py: SchedulerBatchResultProcessor._append_prefill_hidden_states has no keyword-only ['extend_input_len'] "
        "(has ['req', 'logits_output', 'hidden_state_offset', 'store'])"
    ]


def test_fields_are_found_as_annotations_or_self_assignments() -> None:
    module = ast.parse(SOURCE)

    assert _check_fields(module, Fields("x.py", "LogitsProcessorOutput", ("hidden_states", "next_token_logits"))) == []
    assert _check_fields(module, Fields("x.py", "LogitsProcessorOutput", ("last_hidden_states",))) == [
        "x.py: LogitsProcessorOutput has no field last_hidden_states"
    ]


@pytest.mark.skipif(
    not os.environ.get("EAGLE3_SGLANG_SOURCE"),
    reason="set EAGLE3_SGLANG_SOURCE to an unpacked sglang package folder (e.g. from `pip download sglang==0.5.23`)",
)
def test_the_pinned_sglang_source_keeps_the_contract() -> None:
    assert check(Path(os.environ["EAGLE3_SGLANG_SOURCE"])) == []

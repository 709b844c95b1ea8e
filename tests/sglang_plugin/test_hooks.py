"""The hooks' own logic, called the way SGLang v0.5.23 calls the functions they wrap, with stand-in objects.

SGLang is not installed here, so the few `sglang.*` names the hooks import are stand-in modules. These tests
pin the hooks' contract (arguments, return values, what they leave on `Req`); whether SGLang really calls them
with such objects is what the GPU golden check is for.
"""

import asyncio
import dataclasses
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from eagle3_sglang_plugin import hooks
from eagle3_sglang_plugin.capture import CAPTURE_META_KEY, CaptureTicket
from eagle3_sglang_plugin.config import PluginConfig
from eagle3_sglang_plugin.http import wait_until_written

from shared.capture.protocol import read_capture_file

H = 4


@dataclasses.dataclass
class Parallel:
    pp_rank: int = 0
    attn_tp_rank: int = 0
    attn_cp_rank: int = 0


@pytest.fixture
def sglang_stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.SimpleNamespace]:
    """Stand-in `sglang` modules for the names the hooks import; yields the knobs."""
    state = types.SimpleNamespace(parallel=Parallel(), copies=[], registered=[])

    class HookType:
        BEFORE, AFTER, AROUND, REPLACE = "before", "after", "around", "replace"

    class HookRegistry:
        @classmethod
        def register(cls, target: str, hook: Any, hook_type: str) -> None:
            state.registered.append((target, hook, hook_type))

    def async_d2h(tensor: torch.Tensor) -> torch.Tensor:
        state.copies.append(tensor)
        return tensor.clone()

    modules = {
        "sglang": types.SimpleNamespace(__version__="0.5.23"),
        "sglang.srt": types.SimpleNamespace(),
        "sglang.srt.utils": types.SimpleNamespace(),
        "sglang.srt.utils.common": types.SimpleNamespace(async_d2h=async_d2h),
        "sglang.srt.runtime_context": types.SimpleNamespace(get_parallel=lambda: state.parallel),
        "sglang.srt.plugins": types.SimpleNamespace(),
        "sglang.srt.plugins.hook_registry": types.SimpleNamespace(HookRegistry=HookRegistry, HookType=HookType),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    yield state


@pytest.fixture
def shm_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(hooks, "_config", lambda: PluginConfig(shm_dir=tmp_path))
    return tmp_path


class Mode:
    """CaptureHiddenMode's two methods the hook reads."""

    def __init__(self, full: bool) -> None:
        self.full = full

    def is_full(self) -> bool:
        return self.full


def make_req(rid: str, prompt_len: int, ticket: CaptureTicket | None) -> types.SimpleNamespace:
    custom_params = ticket.to_custom_params() if ticket else None
    return types.SimpleNamespace(
        rid=rid,
        origin_input_ids=list(range(prompt_len)),
        sampling_params=types.SimpleNamespace(custom_params=custom_params),
        customized_info=None,
        hidden_states=[],
    )


class StockAppend:
    """Records calls of the original `_append_prefill_hidden_states` and walks offsets as it does in FULL mode."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, processor: Any, **kwargs: Any) -> int:
        self.calls.append(kwargs)
        return kwargs["hidden_state_offset"] + kwargs["extend_input_len"]


def run_result_loop(
    reqs: list, extend_lens: list[int], logits_output: Any, stock: StockAppend, *, full: bool = True
) -> int:
    """The part of process_batch_result_prefill that calls _append_prefill_hidden_states, per request."""
    offset = 0
    for req, extend_len in zip(reqs, extend_lens, strict=True):
        offset = hooks.append_prefill_hidden_states(
            stock,
            object(),
            req=req,
            logits_output=logits_output,
            hidden_state_offset=offset,
            capture_hidden_mode=Mode(full),
            extend_input_len=extend_len,
            store=True,
        )
    return offset


def batch_output(total_rows: int) -> types.SimpleNamespace:
    aux = torch.randn(total_rows, 3 * H).to(torch.bfloat16)
    final = torch.randn(total_rows, H).to(torch.bfloat16)
    return types.SimpleNamespace(hidden_states=aux, last_hidden_states=final)


# ----------------------------------------------------------------------------------------------------------
# _append_prefill_hidden_states


def test_a_mixed_batch_writes_captures_and_leaves_plain_requests_to_sglang(sglang_stand_in: Any, shm_dir: Path) -> None:
    captured_a = make_req("a", 3, CaptureTicket("a.safetensors", (0, 1, 2)))
    plain = make_req("plain", 2, None)
    captured_b = make_req("b", 4, CaptureTicket("b.safetensors", (0, 1, 2)))
    logits_output = batch_output(9)
    stock = StockAppend()

    end = run_result_loop([captured_a, plain, captured_b], [3, 2, 4], logits_output, stock)

    assert end == 9  # the same running offset as the stock walk
    assert [call["req"].rid for call in stock.calls] == ["plain"]
    # The writer threads write off the scheduler's thread; the HTTP side waits for the files the same way.
    asyncio.run(wait_until_written(shm_dir, ["a.safetensors", "b.safetensors"], timeout_s=30))
    aux_b, final_b = read_capture_file(shm_dir / "b.safetensors")
    assert torch.equal(aux_b, logits_output.hidden_states[5:9])
    assert torch.equal(final_b, logits_output.last_hidden_states[5:9])
    assert captured_b.customized_info == {CAPTURE_META_KEY: [{"file": "b.safetensors", "rows": 4, "hidden_size": H}]}
    assert captured_a.hidden_states == [] and captured_b.hidden_states == [], "no JSON floats for a capture"


def test_a_short_extend_reports_the_prefix_hit_instead_of_writing(sglang_stand_in: Any, shm_dir: Path) -> None:
    req = make_req("a", 10, CaptureTicket("a.safetensors", (0, 1, 2)))

    run_result_loop([req], [6], batch_output(6), StockAppend())

    assert "computed 6 of 10" in req.customized_info[CAPTURE_META_KEY][0]["error"]
    assert list(shm_dir.iterdir()) == []


def test_only_the_writer_rank_writes(sglang_stand_in: Any, shm_dir: Path) -> None:
    sglang_stand_in.parallel = Parallel(attn_tp_rank=1)
    req = make_req("a", 3, CaptureTicket("a.safetensors", (0, 1, 2)))

    end = run_result_loop([req], [3], batch_output(3), StockAppend())

    assert end == 3 and req.customized_info is None and list(shm_dir.iterdir()) == []


def test_a_batch_without_full_states_is_left_to_sglang_and_reported(sglang_stand_in: Any, shm_dir: Path) -> None:
    req = make_req("a", 3, CaptureTicket("a.safetensors", (0, 1, 2)))
    stock = StockAppend()

    run_result_loop([req], [3], batch_output(3), stock, full=False)

    assert len(stock.calls) == 1
    assert "mode LAST" in req.customized_info[CAPTURE_META_KEY][0]["error"]


# ----------------------------------------------------------------------------------------------------------
# GenerationBatchResult.copy_to_cpu


def test_the_post_norm_states_are_copied_with_the_aux_states(sglang_stand_in: Any) -> None:
    logits_output = batch_output(3)
    final = logits_output.last_hidden_states
    result = types.SimpleNamespace(logits_output=logits_output)

    hooks.copy_final_hidden_states_to_cpu(result, return_logprob=False, return_hidden_states=True)

    assert sglang_stand_in.copies == [final] and logits_output.last_hidden_states is not final


def test_nothing_is_copied_for_a_batch_without_hidden_states(sglang_stand_in: Any) -> None:
    result = types.SimpleNamespace(logits_output=batch_output(3))

    hooks.copy_final_hidden_states_to_cpu(result, return_logprob=True, return_hidden_states=False)

    assert sglang_stand_in.copies == []


# ----------------------------------------------------------------------------------------------------------
# Scheduler.get_output_streamer_class


@dataclasses.dataclass(kw_only=True, slots=True)
class StockStreamer:
    """Shaped like SchedulerOutputStreamer: a slots dataclass with the request-level predicate."""

    has_additional_customized_info: ClassVar[bool] = False
    server_args: Any = None

    def is_request_level_customized_info_key(self, key: str) -> bool:
        return key == "someone_elses_key"


def test_the_streamer_emits_the_capture_meta_once_per_request() -> None:
    streamer_class = hooks.output_streamer_class(StockStreamer, object())

    streamer = streamer_class(server_args=None)
    assert issubclass(streamer_class, StockStreamer)
    assert streamer.is_request_level_customized_info_key(CAPTURE_META_KEY)
    assert streamer.is_request_level_customized_info_key("someone_elses_key")
    assert not streamer.is_request_level_customized_info_key("per_token_key")
    assert hooks.output_streamer_class(StockStreamer, object()) is streamer_class  # one subclass per base


# ----------------------------------------------------------------------------------------------------------
# Registration


def test_register_hooks_the_five_v0_5_23_targets(sglang_stand_in: Any) -> None:
    hooks.register()

    assert {(target, kind) for target, _, kind in sglang_stand_in.registered} == {
        ("sglang.srt.entrypoints.http_server._setup_and_run_http_server", "before"),
        ("sglang.srt.managers.utils.GenerationBatchResult.copy_to_cpu", "before"),
        (
            "sglang.srt.managers.scheduler_components.batch_result_processor."
            "SchedulerBatchResultProcessor._append_prefill_hidden_states",
            "around",
        ),
        ("sglang.srt.managers.scheduler.Scheduler.get_output_streamer_class", "after"),
        ("sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info", "around"),
    }


# ----------------------------------------------------------------------------------------------------------
# TokenizerManager.update_request_meta_info


def test_plain_requests_batched_with_a_capture_get_no_capture_key() -> None:
    # SGLang's batch customized_info: request 0 is a capture, request 1 a plain request padded with [].
    customized_info = {CAPTURE_META_KEY: [[{"file": "a", "rows": 3, "hidden_size": H}], []], "other": [[1], [2]]}
    seen = []

    def stock(tokenizer_manager: Any, meta_info: dict, state: Any, info: dict, index: int, finish: Any) -> None:
        seen.append(info)
        for key, values in info.items():
            meta_info[key] = values[index]

    for index in (0, 1):
        meta_info: dict[str, Any] = {}
        hooks.update_request_meta_info(stock, object(), meta_info, None, customized_info, index, None)
        seen[-1] = meta_info

    assert seen[0] == {CAPTURE_META_KEY: [{"file": "a", "rows": 3, "hidden_size": H}], "other": [1]}
    assert seen[1] == {"other": [2]}
    assert len(customized_info[CAPTURE_META_KEY]) == 2  # the batch's own dict is left alone

"""The step profile's trace summary: a real torch profiler trace of named forwards (the spans SGLang writes), and the
GPU-side arithmetic on a trace whose kernels and runtime calls are placed by hand (this machine has no GPU)."""

import json
import time
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench import sglang_step_profile
from bench.sglang_step_profile import read_trace, summarize_trace, unprofiled_step_ms
from eagle3.engine_eval import Completion, timed_requests


def test_a_real_trace_gives_one_step_per_decode_forward_and_leaves_out_the_prefill(tmp_path: Path) -> None:
    trace = tmp_path / "server.trace.json"
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _request in range(2):
            with record_function("step[EXTEND bs=1 toks=12]"):
                torch.ones(64).sum()
            for _token in range(4):
                with record_function("step[DECODE bs=1]"):
                    torch.ones(64).sum()
                    time.sleep(0.003)
    profiler.export_chrome_trace(str(trace))

    summary = summarize_trace(read_trace(trace), "DECODE")

    # 4 decode forwards a request: 3 windows each; the window from a request's last decode to the next request's
    # first holds that request's prefill and is not a step.
    assert summary.steps == 6
    assert 3.0 <= summary.period_ms < 100
    assert set(summary.span_ms) == {"DECODE"}
    assert 3.0 <= summary.span_ms["DECODE"] <= summary.period_ms
    assert summary.gpu_busy_ms == 0 and summary.kernels == 0 and summary.gpu_idle == 1


def _event(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 0}


def test_gpu_busy_is_the_union_of_kernel_intervals_and_launches_and_waits_are_counted_per_step() -> None:
    events = []
    for step in range(3):
        t0 = step * 1000.0  # a step every millisecond
        events += [
            _event("user_annotation", "step[VERIFY bs=1]", t0, 300),
            _event("user_annotation", "step[DRAFT bs=1]", t0 + 400, 100),
            _event("user_annotation", "draft", t0 + 390, 150),  # SGLang's stage span around the draft forwards
            _event("gpu_user_annotation", "step[VERIFY bs=1]", t0 + 50, 250),
            _event("cuda_runtime", "cudaGraphLaunch", t0 + 10, 5),
            _event("cuda_runtime", "cudaLaunchKernel", t0 + 20, 5),
            _event("cuda_runtime", "cudaLaunchKernel", t0 + 30, 5),
            _event("cuda_runtime", "cudaStreamSynchronize", t0 + 500, 200),
            # two overlapping kernels (0-200 and 100-300 us) and one apart (600-700): 400 us busy
            _event("kernel", "gemm", t0, 200),
            _event("kernel", "attention", t0 + 100, 200),
            _event("kernel", "gemm", t0 + 600, 100),
            # Python calls (a trace recorded with stacks): the loop covers the step and says nothing, verify does
            _event("python_function", "scheduler.py(900): event_loop", t0, 990),
            _event("python_function", "eagle_worker_v2.py(1979): verify", t0 + 5, 250),
        ]
    events.append(_event("user_annotation", "step[VERIFY bs=1]", 3000.0, 300))  # closes the third step

    summary = summarize_trace(events, "VERIFY")

    assert summary.steps == 3
    assert summary.period_ms == pytest.approx(1.0)
    assert summary.gpu_busy_ms == pytest.approx(0.4)
    assert summary.gpu_idle == pytest.approx(0.6)
    assert (summary.kernels, summary.graph_launches, summary.eager_launches) == (3, 1, 2)
    assert summary.host_wait_ms == pytest.approx(0.2)
    assert summary.span_ms == pytest.approx({"DRAFT": 0.1, "VERIFY": 0.3, "draft": 0.15})
    assert summary.gpu_span_ms == pytest.approx({"VERIFY": 0.25})
    assert summary.top_kernels[0] == ("gemm", pytest.approx(0.3), pytest.approx(2.0))
    assert summary.python_ms == [("eagle_worker_v2.py(1979): verify", pytest.approx(0.25))]


def test_a_trace_without_two_anchors_is_an_error_that_says_what_it_looked_for() -> None:
    with pytest.raises(ValueError, match=r"step\[VERIFY"):
        summarize_trace([_event("user_annotation", "step[DECODE bs=1]", 0, 10)], "VERIFY")


def test_a_random_target_is_a_llama_config_and_its_drafter_an_export_sglang_reads(tmp_path: Path) -> None:
    from transformers import AutoConfig

    from bench.sglang_step_profile import random_target
    from services.trainer.export import CONFIG_FILE, drafter_config_from_sglang

    target, drafter = random_target("small", tmp_path)

    config = AutoConfig.from_pretrained(target)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 256, 4)
    drafter_config = drafter_config_from_sglang(json.loads((drafter / CONFIG_FILE).read_text()), source=drafter)
    assert (drafter_config.hidden_size, drafter_config.vocab_size) == (256, config.vocab_size)
    assert max(drafter_config.aux_layer_ids) < config.num_hidden_layers


@pytest.mark.parametrize("setting", [None, "7,1,8"])
def test_sglang_parses_the_profiles_launch_arguments_as_meant(setting: str | None, tmp_path: Path) -> None:
    from bench.sglang_step_profile import launch_arguments
    from eagle3.engine_eval import SpeculativeConfig
    from eagle3.server_process import stock_argv
    from tests.unit.test_engine_eval import DEVICE_ARGS, sglang_parse

    config = SpeculativeConfig.parse(setting) if setting else None
    extra = launch_arguments(
        config,
        tmp_path / "draft",
        random_weights=True,
        common=" ".join(DEVICE_ARGS),
        variant="--disable-overlap-schedule",
    )

    parsed = sglang_parse(stock_argv(tmp_path / "target", port=31234, extra_args=extra)[2:])

    assert parsed.returncode == 0, parsed.stderr[-2000:]
    values = json.loads(parsed.stdout)
    assert values["load_format"] == "dummy" and values["skip_tokenizer_init"] is True
    assert values["disable_overlap_schedule"] is True and values["cuda_graph_max_bs_decode"] == 4
    assert values["attention_backend"] == "triton"
    if config is None:
        assert values["speculative_algorithm"] is None
    else:
        assert values["speculative_algorithm"] == "EAGLE3" and values["speculative_num_steps"] == 7
        assert values["speculative_draft_load_format"] == "auto"


def test_the_unprofiled_step_is_a_requests_time_less_its_first_token_over_its_steps(
    reference_server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reference server speaks SGLang's /generate (without ignore_eos); its plain answers count no verifications,
    # so a step is a token after the first.
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    latencies, answers = timed_requests(reference_server_url, prompts, 6, ignore_eos=False)
    assert len(latencies) == 2 and all(ms > 0 for ms in latencies)
    assert [a.decoding_steps for a in answers] == [len(a.output_ids) - 1 for a in answers]
    assert all(a.decoding_steps > 0 for a in answers)

    # The arithmetic on fixed times (a live server's differences are noise-sized on a loaded 2-core machine): one-token
    # requests of 10 and 12 ms, full ones of 40 and 52 ms of 5 steps each: (92 - 22) / 10 steps.
    def fixed(
        url: str, prompts: list[list[int]], max_new_tokens: int, *, ignore_eos: bool
    ) -> tuple[list[float], list[Completion]]:
        if max_new_tokens == 1:
            return [10.0, 12.0], [Completion(output_ids=[1])] * 2
        return [40.0, 52.0], [Completion(output_ids=[1] * 6)] * 2

    monkeypatch.setattr(sglang_step_profile, "timed_requests", fixed)
    assert unprofiled_step_ms(reference_server_url, prompts, max_new_tokens=6, ignore_eos=False) == 7.0

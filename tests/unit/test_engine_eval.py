"""`eagle3 eval --engine sglang` on the CPU: its launch arguments read by SGLang 0.5.23's own parser, its numbers
from SGLang's answers (the shape `/generate` sends with speculative decoding on: tokenizer_manager's
`_calculate_spec_decoding_metrics`), its settings and its errors. The measurement itself needs a GPU: it runs on
the lent H200 (docs/benchmarks.md)."""

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from eagle3 import cli
from eagle3.engine_eval import (
    Completion,
    DrafterSource,
    EngineEvalOptions,
    EngineResult,
    ServerRun,
    SpeculativeConfig,
    best_setting,
    drafters_from_folder,
    engine_acceptance,
    evaluate_on_engine,
    generate,
    load_requests,
    matching_outputs,
    measure_launched,
    position_acceptance,
    print_engine_report,
    serving_args,
)
from eagle3.server_process import stock_argv
from shared.errors import ConfigurationError
from tests.trainer.test_export import bf16_drafter

ROOT = Path(__file__).resolve().parents[2]
SGLANG_CPU = ROOT / ".venv" / "sglang-cpu"  # Makefile: SGLang's parser, installed without its GPU dependencies
PARSE = ROOT / "tests" / "fixtures" / "sglang_parse.py"
# What the lent H200's SGLang set-up adds to every launch (its FA3 library is not carried; docs/benchmarks.md), and
# what scripts/gpu_product.sh adds to the evaluation's (each request's time in the log).
DEVICE_ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--disable-radix-cache"]
EVAL_LOG_ARGS = ["--enable-request-time-stats-logging"]


def sglang_parse(argv: list[str]) -> subprocess.CompletedProcess:
    if not (SGLANG_CPU / "sglang").is_dir():
        pytest.skip(f"SGLang's parser is not installed in {SGLANG_CPU} (make install)")
    return subprocess.run(
        [sys.executable, str(PARSE)],
        input=json.dumps(argv),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SGLANG_CPU)},
        timeout=120,
    )


@pytest.mark.parametrize("setting", ["7,1,8", "3,1,4", "5,4,16", "7,4,16", "7,8,32"])
def test_sglang_parses_our_launch_arguments_as_meant(setting: str, tmp_path: Path) -> None:
    config = SpeculativeConfig.parse(setting)
    options = EngineEvalOptions(settings=[config], concurrency=16, sglang_args=DEVICE_ARGS + EVAL_LOG_ARGS)
    argv = stock_argv(tmp_path / "target", port=31234, extra_args=serving_args(options, config, tmp_path / "draft"))

    parsed = sglang_parse(argv[2:])  # after "-m sglang.launch_server"

    assert parsed.returncode == 0, parsed.stderr[-2000:]
    values = json.loads(parsed.stdout)
    assert values["model_path"] == str(tmp_path / "target") and values["port"] == 31234
    assert values["speculative_algorithm"] == "EAGLE3"
    assert values["speculative_draft_model_path"] == str(tmp_path / "draft")
    assert (values["speculative_num_steps"], values["speculative_eagle_topk"]) == (config.steps, config.topk)
    assert values["speculative_num_draft_tokens"] == config.draft_tokens
    assert not values["disable_cuda_graph"]  # served as users serve it
    assert values["cuda_graph_max_bs_decode"] == 16  # graphs for every batch measured, and no larger
    assert values["attention_backend"] == "triton" and values["disable_radix_cache"]
    assert values["enable_request_time_stats_logging"]


def test_the_plain_launch_parses_without_speculation(tmp_path: Path) -> None:
    options = EngineEvalOptions(settings=[], concurrency=8)
    parsed = sglang_parse(stock_argv(tmp_path, port=30001, extra_args=serving_args(options, None))[2:])
    assert parsed.returncode == 0, parsed.stderr[-2000:]
    values = json.loads(parsed.stdout)
    assert values["speculative_algorithm"] is None and not values["disable_cuda_graph"]
    assert values["cuda_graph_max_bs_decode"] == 8
    mine = EngineEvalOptions(settings=[], concurrency=8, sglang_args=["--cuda-graph-max-bs-decode", "64"])
    assert serving_args(mine, None) == ["--cuda-graph-max-bs-decode", "64"]  # the user's size wins


def test_sglangs_parser_really_checks(tmp_path: Path) -> None:
    """The check above can fail: a flag SGLang 0.5.23 does not know, or an ambiguous prefix of two it does
    (`--cuda-graph-max-bs`, which a first version of the evaluation passed), is refused."""
    for wrong in (["--speculative-num-stepz", "5"], ["--cuda-graph-max-bs", "16"]):
        parsed = sglang_parse(["--model-path", str(tmp_path), *wrong])
        assert parsed.returncode == 2 and wrong[0] in parsed.stderr


def test_settings_say_what_sglang_would_change() -> None:
    assert SpeculativeConfig.parse("7,1,8").chain and not SpeculativeConfig.parse("5,4,16").chain
    with pytest.raises(ConfigurationError, match="steps \\+ 1 = 8"):
        SpeculativeConfig.parse("7,1,16")  # SGLang would quietly verify 8
    with pytest.raises(ConfigurationError, match="at most steps \\* topk \\+ 1"):
        SpeculativeConfig.parse("2,2,8")
    with pytest.raises(ConfigurationError, match="STEPS,TOPK,DRAFT_TOKENS"):
        SpeculativeConfig.parse("7-1-8")
    info = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 5, "speculative_eagle_topk": 1}
    assert SpeculativeConfig.from_server_info(info | {"speculative_num_draft_tokens": 6}).label == "5,1,6"
    with pytest.raises(ConfigurationError, match="serves no EAGLE-3 drafter"):
        SpeculativeConfig.from_server_info({"speculative_algorithm": None})


def answer(output_ids: list[int], verify_ct: int, histogram: list[int]) -> dict:
    """A speculative `/generate` answer as SGLang 0.5.23 builds it (meta_info of a finished request)."""
    correct = sum(j * count for j, count in enumerate(histogram))
    return {
        "text": "",
        "output_ids": output_ids,
        "meta_info": {
            "id": "x",
            "prompt_tokens": 12,
            "completion_tokens": len(output_ids),
            "spec_verify_ct": verify_ct,
            "spec_num_correct_drafts": correct,
            "spec_accept_length": len(output_ids) / verify_ct,  # SGLang's own, which counts the prefill token
            "spec_correct_drafts_histogram": histogram,
        },
    }


def test_acceptance_from_sglangs_counters() -> None:
    # 9 tokens: 1 from the prefill, then 3 steps of 3, 1 and 4 tokens (2, 0 and 3 drafts accepted).
    first = Completion.from_response(answer(list(range(9)), 3, [1, 0, 1, 1]))
    # 5 tokens: the prefill's, then 2 steps of 2 tokens each.
    second = Completion.from_response(answer(list(range(5)), 2, [0, 2]))
    plain = Completion.from_response({"output_ids": [1, 2], "meta_info": {"completion_tokens": 2}})

    assert first.acceptance_length == pytest.approx(8 / 3) and second.acceptance_length == pytest.approx(2.0)
    assert plain.verify_steps is None and plain.acceptance_length is None
    result = engine_acceptance([first, second])
    assert result.prompts == 2 and result.new_tokens == 14 and result.verify_steps == 5
    assert result.acceptance_length == pytest.approx((8 / 3 + 2.0) / 2)
    assert result.pooled_acceptance_length == pytest.approx(12 / 5)
    low, high = result.acceptance_length_ci95
    assert low < result.acceptance_length < high
    # Steps with >= 1, >= 2, >= 3 drafts correct, over 5 steps: 4, 2 and 1.
    assert result.position_acceptance == pytest.approx([4 / 5, 2 / 5, 1 / 5])


def test_positions_are_left_out_when_sglang_sends_no_histogram() -> None:
    completion = Completion(output_ids=[1, 2, 3], verify_steps=1)
    assert position_acceptance([completion]) == []
    assert math.isnan(engine_acceptance([completion]).acceptance_length_ci95[0])


def test_an_answer_without_token_ids_is_an_error() -> None:
    with pytest.raises(Exception, match="without output_ids"):
        Completion.from_response({"text": "hi", "meta_info": {}})


def test_a_connection_the_server_closed_as_idle_is_retried_once_and_a_second_failure_is_raised() -> None:
    calls: list[int] = []

    def closes_first(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return httpx.Response(200, json=answer([5, 6, 7], 2, [1, 1]))

    with httpx.Client(transport=httpx.MockTransport(closes_first)) as client:
        assert generate(client, "http://sglang", [1, 2], max_new_tokens=3).output_ids == [5, 6, 7]
    assert len(calls) == 2

    def always_closes(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)

    with httpx.Client(transport=httpx.MockTransport(always_closes)) as client, pytest.raises(httpx.RemoteProtocolError):
        generate(client, "http://sglang", [1, 2], max_new_tokens=3)


def test_outputs_are_compared_token_for_token_and_requests_keep_the_server_loaded() -> None:
    ours = [Completion([1, 2, 3]), Completion([4, 5])]
    assert matching_outputs(ours, [Completion([1, 2, 3]), Completion([4, 6])]) == 1
    assert len(load_requests([[1], [2], [3]], 16)) == 33  # at least 2 x 16, whole passes over the prompts
    assert len(load_requests([[1]] * 40, 16)) == 40


def row(drafter: str, setting: str, engine: float, plain: float, acceptance: float) -> EngineResult:
    completions = [Completion(list(range(int(acceptance * 4) + 1)), verify_steps=4)]
    return EngineResult(
        file="/data/code.jsonl",
        drafter=drafter,
        setting=setting,
        acceptance=engine_acceptance(completions),
        matches_greedy=1,
        tokens_per_s=engine,
        plain_tokens_per_s=plain,
        concurrent_tokens_per_s=engine * 8,
        plain_concurrent_tokens_per_s=plain * 10,
    )


def test_a_disagreement_with_our_own_eval_is_said_with_both_numbers() -> None:
    close, far = row("trained", "7,1,8", 500, 400, 2.0), row("trained", "7,1,8", 500, 400, 2.0)
    close.compare_with_own(2.1)
    far.compare_with_own(2.5)
    assert close.notes == []
    assert far.notes and "2.000" in far.notes[0] and "2.500" in far.notes[0] and "20%" in far.notes[0]


def test_a_step_costs_the_batch_1_time_less_a_first_token_per_prompt() -> None:
    """9 tokens at 500 tokens/s are 18 ms, 2 of them the first token's: 16 ms over 4 verification steps. Plain: 9
    tokens at 400 tokens/s are 22.5 ms, 2.5 the first token's: 20 ms over the 8 tokens after it."""
    result = row("trained", "7,1,8", 500, 400, 2.0)
    assert result.step_ms is None and result.plain_token_ms is None  # no first-token latency measured
    result.first_token_ms, result.plain_first_token_ms, result.plain_new_tokens = 2.0, 2.5, 9
    assert result.step_ms == pytest.approx(4.0) and result.plain_token_ms == pytest.approx(2.5)
    result.first_token_ms = 50.0  # more than the whole run: not a time
    assert result.step_ms is None


def test_a_requests_fixed_cost_is_told_from_its_steps_by_two_lengths() -> None:
    """Requests of 128 tokens in 40 verification steps take 180 ms, of 16 tokens in 5 steps 110 ms: 2 ms a step and
    100 ms a request besides. Plain counts the tokens after the first as its steps."""
    full = [Completion(list(range(128)), verify_steps=40) for _ in range(2)]
    speculative = ServerRun(full, tokens_per_s=256 / 0.360, concurrent_tokens_per_s=None)
    assert speculative.request_fixed_ms() is None  # no short requests measured
    speculative.short_request_ms, speculative.short_request_steps = 110.0, 5.0
    assert speculative.request_fixed_ms() == pytest.approx(100.0)

    # 129 tokens in 202 ms, 16 in 32.5 ms: 1.5 ms for each token after the first, 10 ms a request besides.
    plain = ServerRun([Completion(list(range(129)))], tokens_per_s=129 / 0.202, concurrent_tokens_per_s=None)
    plain.short_request_ms, plain.short_request_steps = 32.5, 15.0
    assert plain.request_fixed_ms() == pytest.approx(10.0)
    same = ServerRun(full, tokens_per_s=256 / 0.360, concurrent_tokens_per_s=None, short_request_ms=180.0)
    same.short_request_steps = 40.0  # the short requests took as many steps: no line through two points
    assert same.request_fixed_ms() is None


def test_the_table_and_the_fastest_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [row("trained", "7,1,8", 500, 400, 2.0), row("trained", "3,1,4", 700, 400, 1.75)]
    rows.append(row("untrained", "3,1,4", 300, 400, 1.0))
    report = {
        "checkpoint": "job/trainer/run",
        "step": 10,
        "max_new_tokens": 64,
        "concurrency": 16,
        "repeats": 2,
        "results": [r.as_dict() for r in rows],
        "best_setting": best_setting(rows),
        "refused": [{"drafter": "trained", "setting": "5,4,16", "reason": "server exited\nValueError: no trees"}],
    }
    assert report["best_setting"] == {"setting": "3,1,4", "median_speedup": pytest.approx(1.75)}
    from rich.console import Console

    console = Console(width=300, record=True, file=io.StringIO())
    print_engine_report(report, console)
    text = console.export_text()
    assert "1.25x" in text and "1.75x" in text and "0.75x" in text and "code.jsonl" in text
    # 7,1,8: 2 tokens a step at 500 tokens/s is 4 ms a step, 1.6 plain tokens at 400 tokens/s: even at 1.6
    assert rows[0].break_even_acceptance == pytest.approx(1.6) and " 1.60 " in text
    assert "trained, 5,4,16: SGLang did not serve it (ValueError: no trees)" in text
    assert "fastest setting at batch 1: 3,1,4 (1.75x plain, median)" in text


def test_the_command_refuses_what_it_cannot_measure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="give --prompts-file"):
        cli.main(["eval", "--checkpoint", "x", "--engine", "sglang"])
    with pytest.raises(SystemExit):
        cli.main(["eval", "--checkpoint", "x", "--engine", "sglang", "--speculative", "7,1,16"])
    assert "with topk 1 SGLang verifies steps + 1 = 8 tokens" in capsys.readouterr().err


def test_a_draft_folder_is_served_without_its_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    """An export (ours here; SpecForge's has the same shape) evaluates without the checkpoint it came from: the
    folder's weights, and as the untrained yardstick the warm start from the target with the folder's draft
    vocabulary and aux layers."""
    from services.trainer.drafter import build_drafter
    from services.trainer.export import export_sglang
    from shared.data.vocab import VocabMapping

    drafter = bf16_drafter(tiny_model_dir)
    folder = export_sglang(drafter, tmp_path / "export")

    source = drafters_from_folder(folder, model_path=str(tiny_model_dir), baseline=True)

    assert source.name == str(folder) and source.target == tiny_model_dir and source.step is None
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(source.trained.state_dict()[name], tensor), name
    assert source.untrained is not None
    assert source.untrained.config.aux_layer_ids == drafter.config.aux_layer_ids
    assert torch.equal(source.untrained.d2t, drafter.d2t) and torch.equal(source.untrained.t2d, drafter.t2d)
    torch.manual_seed(0)
    vocab = VocabMapping(drafter.d2t, drafter.t2d, None, drafter.config.draft_vocab_size)
    warm_start = build_drafter(tiny_model_dir, vocab, aux_layer_ids=list(drafter.config.aux_layer_ids))[0]
    for name, tensor in warm_start.state_dict().items():
        assert torch.equal(source.untrained.state_dict()[name], tensor), name
    assert drafters_from_folder(folder, model_path=str(tiny_model_dir), baseline=False).untrained is None
    with pytest.raises(ConfigurationError, match="--model"):
        drafters_from_folder(folder, model_path=None, baseline=False)


def test_the_command_serves_a_checkpoint_or_a_folder(tmp_path: Path) -> None:
    files = ["--prompts-file", str(tmp_path / "code.jsonl")]
    with pytest.raises(SystemExit, match="give one of the two"):
        cli.main(["eval", "--engine", "sglang", *files])
    with pytest.raises(SystemExit, match="give one of the two"):
        cli.main(["eval", "--engine", "sglang", "--checkpoint", "x", "--drafter", str(tmp_path), *files])
    with pytest.raises(SystemExit, match="needs --engine sglang"):
        cli.main(["eval", "--drafter", str(tmp_path), *files])
    with pytest.raises(SystemExit, match="give --checkpoint"):
        cli.main(["eval", *files])


def stand_in_sglang_python(tmp_path: Path) -> Path:
    """A `--sglang-python` that runs tests/fixtures/stand_in_sglang.py in SGLang's place."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {ROOT / "tests" / "fixtures" / "stand_in_sglang.py"} "$@"\n')
    python.chmod(0o755)
    return python


TWO_PROMPTS = {"code.jsonl": [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]}


def stand_in_evaluation(
    model_dir: Path, tmp_path: Path, settings: list[str], *, resume: bool = False
) -> tuple[dict[str, Any], EngineEvalOptions]:
    """A trained and an untrained drafter, and the options that serve them at `settings` from stand-in servers."""
    drafters = {"trained": bf16_drafter(model_dir), "untrained": bf16_drafter(model_dir)}
    python = stand_in_sglang_python(tmp_path)
    parsed = [SpeculativeConfig.parse(setting) for setting in settings]
    return drafters, EngineEvalOptions(
        settings=parsed, concurrency=2, repeats=1, sglang_python=str(python), resume=resume
    )


def test_every_server_is_launched_and_measured_against_the_plain_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The orchestration with stand-in servers (tests/fixtures/stand_in_sglang.py) in SGLang's place: one plain
    server, one per trained setting and one untrained at the first; the first speculative server starts alone."""
    drafters, options = stand_in_evaluation(tiny_model_dir, tmp_path, ["7,1,8", "3,1,4"])

    results = measure_launched(tiny_model_dir, drafters, TWO_PROMPTS, options, tmp_path / "work").results

    assert [(r.drafter, r.setting) for r in results] == [
        ("trained", "7,1,8"),
        ("trained", "3,1,4"),
        ("untrained", "7,1,8"),
    ]
    for result in results:
        assert result.matches_greedy == 2 and result.plain_tokens_per_s and result.concurrent_tokens_per_s
        assert result.acceptance.acceptance_length == pytest.approx(2.0)  # (5 - 1) / 2 verification steps
        assert result.acceptance.position_acceptance == [1.0]
        assert result.first_token_ms and result.plain_first_token_ms and result.plain_new_tokens == 10
    logs = sorted((tmp_path / "work").rglob("sglang-*.log"))
    # One at a time, each with SGLang's own share of the GPU: no memory fraction of ours.
    assert len(logs) == 4 and not any("--mem-fraction-static" in log.read_text() for log in logs)
    untrained = (tmp_path / "work" / "untrained" / "sglang-7-1-8.log").read_text()
    assert f"--speculative-draft-model-path {tmp_path / 'work' / 'drafter-untrained'}" in untrained
    assert len(json.loads((tmp_path / "work" / "engine-eval-partial.json").read_text())["results"]) == 3


def test_a_setting_sglang_does_not_serve_is_said_and_the_sweep_goes_on(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A server that exits before it is healthy (the stand-in refuses trees) leaves a row that says why; the other
    settings and the untrained drafter are measured, and a resumed evaluation does not launch it again."""
    drafters, options = stand_in_evaluation(tiny_model_dir, tmp_path, ["7,1,8", "5,4,16"], resume=True)
    work = tmp_path / "work"

    progress = measure_launched(tiny_model_dir, drafters, TWO_PROMPTS, options, work)

    assert [(r.drafter, r.setting) for r in progress.results] == [("trained", "7,1,8"), ("untrained", "7,1,8")]
    [refused] = progress.refused
    assert (refused["drafter"], refused["setting"]) == ("trained", "5,4,16")
    assert "serves chains only" in refused["reason"]
    tree_log = work / "trained" / "sglang-5-4-16.log"
    launched = tree_log.stat().st_mtime_ns
    again = measure_launched(tiny_model_dir, drafters, TWO_PROMPTS, options, work)
    assert again.refused == progress.refused and tree_log.stat().st_mtime_ns == launched


def test_a_resumed_evaluation_measures_only_what_is_missing(tiny_model_dir: Path, tmp_path: Path) -> None:
    """An evaluation cut short (here: its last server's row taken out of the partial file, as if the command had
    ended while that server ran) goes on with that server alone; another drafter starts afresh."""
    drafters, options = stand_in_evaluation(tiny_model_dir, tmp_path, ["7,1,8", "3,1,4"], resume=True)
    work = tmp_path / "work"
    first = measure_launched(tiny_model_dir, drafters, TWO_PROMPTS, options, work).results

    partial = work / "engine-eval-partial.json"
    saved = json.loads(partial.read_text())
    saved["results"] = saved["results"][:2]  # the untrained server's row was never written
    partial.write_text(json.dumps(saved))
    logs = {log: log.stat().st_mtime_ns for log in work.rglob("sglang-*.log")}
    resumed = measure_launched(tiny_model_dir, drafters, TWO_PROMPTS, options, work).results

    # The rows measured before come back as they were; the new one is measured against the saved plain runs.
    assert [r.as_dict() for r in resumed[:2]] == [r.as_dict() for r in first[:2]]
    new = resumed[2]
    assert (new.drafter, new.setting, new.acceptance) == ("untrained", "7,1,8", first[2].acceptance)
    assert new.plain_tokens_per_s == first[2].plain_tokens_per_s and new.matches_greedy == 2
    relaunched = [log.relative_to(work) for log in work.rglob("sglang-*.log") if log.stat().st_mtime_ns != logs[log]]
    assert relaunched == [Path("untrained/sglang-7-1-8.log")]

    with torch.no_grad():
        drafters["trained"].lm_head.weight.add_(1.0)  # another drafter: nothing measured before counts
    measure_launched(tiny_model_dir, drafters, TWO_PROMPTS, options, work)
    assert all(log.stat().st_mtime_ns != logs[log] for log in work.rglob("sglang-*.log"))


def test_the_own_measurement_decodes_with_the_drafters_it_is_given(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The GPU demo's evaluation: SGLang's numbers for both drafters (stand-in servers here), the project's own
    decoding beside them for the trained drafter only."""
    drafters, options = stand_in_evaluation(tiny_model_dir, tmp_path, ["7,1,8"])
    options.max_new_tokens, options.own_drafters = 8, ("trained",)
    prompts = tmp_path / "code.jsonl"
    turns = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "return a + b"}]
    prompts.write_text(json.dumps({"messages": turns}) + "\n")
    source = DrafterSource("stand-in", tiny_model_dir, drafters["trained"], drafters["untrained"])

    report = evaluate_on_engine(source, [prompts], options=options)

    own = {row["drafter"]: row["own_acceptance_length"] for row in report["results"]}
    assert set(own) == {"trained", "untrained"}
    assert own["trained"] is not None and own["trained"] >= 1.0 and own["untrained"] is None, own

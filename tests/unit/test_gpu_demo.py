"""`eagle3 demo --gpu` without a GPU: its sizes apply only with --gpu, and its report sets every stage against
SGLang's own rate on the same work. The run itself is on the lent H200 (docs/benchmarks.md)."""

import json
from pathlib import Path

import pytest

from eagle3 import cli, gpu_demo
from eagle3.demo import CPU_DEFAULTS, apply_defaults
from eagle3.gpu_demo import (
    GPU_DEFAULTS,
    capture_server_argv,
    regeneration_shard_size,
    send_from_processes,
    sglang_baselines,
    stage_summary,
)
from shared.data.datasets import Conversation, Message
from shared.errors import Eagle3Error
from tests.unit.test_engine_eval import sglang_parse


def parsed(*argv: str):
    return cli.build_parser().parse_args(["demo", *argv])


def test_gpu_sizes_apply_only_with_gpu_and_flags_win() -> None:
    cpu, gpu = parsed(), parsed("--gpu", "--workers", "8")
    apply_defaults(cpu, CPU_DEFAULTS)
    apply_defaults(gpu, GPU_DEFAULTS)
    assert (cpu.workers, cpu.shard_token_budget, cpu.draft_vocab_size) == (2, 2048, 2048)
    assert (gpu.workers, gpu.shard_token_budget, gpu.draft_vocab_size) == (8, 65536, 16384)
    # Every size the CPU demo fixes, the GPU demo sizes too: as a default, or from the prompts (the shard size).
    assert set(CPU_DEFAULTS) <= set(GPU_DEFAULTS) | {"regenerate_shard_size"}


@pytest.mark.parametrize(
    ("conversations", "shard_size"),
    [
        (16000, 512),  # four times the 128 in flight per worker: threads take queued conversations as others finish
        (2000, 250),  # two shards per worker, none idle
        (100, 13),
        (1, 1),
    ],
)
def test_gpu_regeneration_shards_queue_more_than_a_worker_decodes_but_leave_no_worker_idle(
    conversations: int, shard_size: int
) -> None:
    assert regeneration_shard_size(conversations, workers=4, concurrency=128) == shard_size


def test_the_report_sets_each_stage_against_sglangs_own_rate() -> None:
    report = {
        "stack_start_seconds": 126.6,
        "regeneration": {"wall_seconds": 201.5, "generated_tokens": 1816577, "generated_tokens_per_second": 9017.1},
        "extraction": {"wall_seconds": 12.1, "tokens_committed": 2344378, "tokens_per_second": 193054.0},
        "training": {"wall_seconds": 182.6, "train_tokens": 16570242, "tokens_per_second": 91979.7, "steps": 567},
        "engine_eval_seconds": 300.0,
        "sglang_baseline": {
            "decode_tokens_per_second": 10019.0,
            "decode_client_cpu_share": 0.97,
            "prefill_tokens_per_second": 386108.0,
        },
    }
    lines = stage_summary(report).splitlines()
    regeneration = next(line for line in lines if line.startswith("regeneration"))
    extraction = next(line for line in lines if line.startswith("extraction"))
    assert "0.90x SGLang's own decoding (10,019 tok/s), its client at 0.97 CPU-seconds a second" in regeneration
    assert "0.50x SGLang's own prefill (386,108 tok/s)" in extraction
    assert lines[-1].split() == ["the", "stages", "822.8", "s"]  # 126.6 + 201.5 + 12.1 + 182.6 + 300.0
    del report["sglang_baseline"]
    assert "SGLang's own" not in stage_summary(report)


def test_the_yardstick_decodes_and_prefills_the_jobs_work_on_a_real_server_and_says_its_clients_cpu(
    reference_server_url: str, tiny_model_dir: Path
) -> None:
    conversations = [
        Conversation(f"c{i}", i + 1, [Message("user", f"Count to {i}, please."), Message("assistant", "1, 2, 3")])
        for i in range(6)
    ]
    baseline = sglang_baselines(
        reference_server_url,
        conversations,
        tiny_model_dir,
        client_processes=2,
        decode_concurrency=3,
        prefill_concurrency=2,
        max_new_tokens=4,
        max_length=128,
    )
    assert baseline["client_processes"] == 2
    assert baseline["decode_turns"] == 6 and baseline["prefill_conversations"] == 6
    assert 0 < baseline["decode_generated_tokens"] <= 6 * 4 and baseline["decode_tokens_per_second"] > 0
    assert baseline["prefill_tokens"] > 6 * 5 and baseline["prefill_tokens_per_second"] > 0
    # The client processes' CPU time while their threads waited on the server: some, not more than two cores give.
    assert 0 < baseline["decode_client_cpu_share"] <= 2.5


def test_a_yardstick_client_that_cannot_reach_the_server_fails_as_the_demo_expects() -> None:
    # The demo keeps the job's report and says why the yardstick is missing on an Eagle3Error (httpx's own errors
    # cannot come back from a client process).
    with pytest.raises(Eagle3Error, match=r"SGLang at http://127\.0\.0\.1:9"):
        send_from_processes("http://127.0.0.1:9", [[1, 2, 3]] * 4, max_new_tokens=1, processes=2, concurrency=2)


def test_a_dataset_without_held_out_prompts_is_refused() -> None:
    with pytest.raises(SystemExit, match="--dataset needs --eval-prompts-file"):
        cli.main(["demo", "--gpu", "--dataset", "train.jsonl"])


def test_resume_needs_the_report_of_an_earlier_run(tmp_path) -> None:
    with pytest.raises(SystemExit, match="--resume: no report at"):
        cli.main(["demo", "--gpu", "--resume", "--report", str(tmp_path / "report.json")])


def test_resume_skips_the_stages_the_report_holds(tmp_path, tiny_model_dir, capsys) -> None:
    report = tmp_path / "report.json"
    done = {"extraction": {"job_id": "job-x"}, "training": {"checkpoint": "job-x/trainer/demo-gpu/step_1.pt"}}
    report.write_text(json.dumps(done))
    cli.main(
        ["demo", "--gpu", "--resume", "--until", "training", "--report", str(report), "--model", str(tiny_model_dir)]
    )
    out = capsys.readouterr().out
    assert "extraction job job-x: done before" in out and "job-x/trainer/demo-gpu/step_1.pt: trained before" in out
    assert json.loads(report.read_text()) == done  # nothing ran, nothing was rewritten


@pytest.mark.parametrize(
    ("flags", "baseline", "own"),
    [([], True, True), (["--no-baseline"], False, True), (["--no-baseline", "--no-own-eval"], False, False)],
)
def test_the_evaluation_serves_the_untrained_drafter_and_decodes_its_own_unless_told_not_to(
    flags: list[str], baseline: bool, own: bool, tmp_path, tiny_model_dir, monkeypatch
) -> None:
    report = tmp_path / "report.json"
    done = {"extraction": {"job_id": "job-x"}, "training": {"checkpoint": "job-x/trainer/demo-gpu/step_1.pt"}}
    report.write_text(json.dumps({**done, "eval_files": []}))
    seen: dict = {}

    def drafters(checkpoint: str, **kwargs):
        seen["baseline"] = kwargs["baseline"]
        return "drafters"

    def evaluate(source, files, *, options):
        seen.update(source=source, compare_own=options.compare_own, own_drafters=options.own_drafters)
        raise SystemExit("measured no further")  # the wiring is what this test reads; serving needs a GPU

    monkeypatch.setattr(gpu_demo, "drafters_from_checkpoint", drafters)
    monkeypatch.setattr(gpu_demo, "evaluate_on_engine", evaluate)
    argv = ["demo", "--gpu", "--resume", "--report", str(report), "--model", str(tiny_model_dir), *flags]
    with pytest.raises(SystemExit, match="measured no further"):
        cli.main(argv)
    assert seen == {"baseline": baseline, "source": "drafters", "compare_own": own, "own_drafters": ("trained",)}


def test_the_capture_server_graphs_cover_every_regeneration_request_in_flight() -> None:
    args = parsed("--gpu", "--sglang-args", "--attention-backend triton")
    apply_defaults(args, GPU_DEFAULTS)
    argv = capture_server_argv(args)
    assert argv[1:3] == ["-m", "eagle3_sglang_plugin.launch"]
    assert argv[3:] == ["--attention-backend", "triton", "--cuda-graph-max-bs-decode", str(4 * 128)]
    mine = parsed("--gpu", "--sglang-args", "--cuda-graph-max-bs-decode 64")
    apply_defaults(mine, GPU_DEFAULTS)
    assert capture_server_argv(mine)[3:] == ["--cuda-graph-max-bs-decode", "64"]


def test_sglang_reads_the_graph_size_as_its_decode_graphs_limit(tmp_path) -> None:
    args = parsed("--gpu")
    apply_defaults(args, GPU_DEFAULTS)
    parsed_by_sglang = sglang_parse(["--model-path", str(tmp_path), *capture_server_argv(args)[3:]])
    assert parsed_by_sglang.returncode == 0, parsed_by_sglang.stderr
    assert json.loads(parsed_by_sglang.stdout)["cuda_graph_max_bs_decode"] == 4 * 128

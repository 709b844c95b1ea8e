"""A kind's command is its declaration (JobKind.command, shared/lifecycle/command.py): `eagle3/jobs.py` builds one
subcommand per registered kind, offering the options the kind declares (KindOptions) by the flags its command names,
and shows what the kind's `follow` says once the job is submitted. A new kind gets its command from its module and
its registry line alone."""

import argparse
import json
from typing import Any, ClassVar

import httpx
import pytest
from pydantic import BaseModel, Field

from eagle3 import jobs
from shared.lifecycle.command import KindCommand, Positional
from shared.lifecycle.kind import JobKind, KindOptions, KindRecord
from shared.lifecycle.kinds import KINDS, registry
from shared.settings import Settings


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="eagle3")
    jobs.add_parsers(root.add_subparsers(dest="command"))
    return root


def commands(root: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [action for action in root._actions if isinstance(action, argparse._SubParsersAction)]
    return sub.choices


def test_the_audit_command_offers_its_declared_options_by_their_flags() -> None:
    args = parser().parse_args(["audit", "job-1", "--samples", "3", "--backend", "reference", "--seed", "2"])
    assert (args.source_job_id, args.audit_samples, args.audit_backend_url, args.seed) == ("job-1", 3, "reference", 2)
    with pytest.raises(SystemExit):  # the source job is the positional JOB, not a flag
        parser().parse_args(["audit", "job-1", "--source-job-id", "job-2"])


def test_the_regenerate_command_takes_its_output_as_out() -> None:
    args = parser().parse_args(["regenerate", "chats.jsonl", "--out", "regenerated.jsonl", "--max-new-tokens", "9"])
    assert (args.output_url, args.max_new_tokens) == ("regenerated.jsonl", 9)
    with pytest.raises(SystemExit):
        parser().parse_args(["regenerate", "chats.jsonl", "--output-url", "x"])


def test_every_kind_has_its_command_and_extract_keeps_submit() -> None:
    assert {"submit", "regenerate", "audit"} <= set(commands(parser()))
    assert {kind.command_name for kind in KINDS.values()} == {"submit", "regenerate", "audit"}


class SummarizeOptions(KindOptions):
    source_job_id: str | None = Field(default=None, description="the regenerate job to summarize")
    max_words: int = Field(default=50, ge=1, description="words per summary")
    tone: str = Field(default="plain", description="how the summaries read")


class SummarizeInput(BaseModel):
    job_id: str


class Summarize(JobKind):
    """A kind added in a test: declarations only, its work never runs here."""

    name = "summarize"
    options = SummarizeOptions
    record = KindRecord
    finalizes = False
    input_type = SummarizeInput
    manifest_type = SummarizeInput
    reads_dataset: ClassVar[bool] = False
    command = KindCommand(
        help="summarize every conversation of a job",
        description="Submits a job of kind summarize and shows its size.",
        positionals=(Positional("source_job_id", metavar="JOB"),),
        common_options=("job_id",),
        flags={"max_words": ("--words",)},
        watch_help="follow it to its end",
    )

    def plan(self, *args: object) -> Any: ...

    open = prepare = items = item_key = reuse = process = plan


@pytest.fixture
def summarize(monkeypatch: pytest.MonkeyPatch) -> Summarize:
    """The kind, registered beside the others for the test (the registry checks it as it checks theirs)."""
    kind = Summarize()
    for name, registered in registry([*KINDS.values(), kind]).items():
        monkeypatch.setitem(KINDS, name, registered)
    return kind


def test_a_new_kinds_command_comes_from_its_declaration(
    summarize: Summarize, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = parser()
    help_text = commands(root)["summarize"].format_help()
    assert "Submits a job of kind summarize" in help_text and "JOB" in help_text and "--words" in help_text
    assert "the regenerate job to summarize" in help_text and "--tone" in help_text and "--watch" in help_text
    assert "--upload" not in help_text and "--max-length" not in help_text  # no dataset, not an extraction
    assert "summarize every conversation of a job" in root.format_help()

    posted: list[dict] = []

    def producer(request: httpx.Request) -> httpx.Response:
        posted.append(json.loads(request.content))
        record = {"job_id": "sum-1", "samples_total": 4, "samples_rejected": 0, "tokens_total": 80, "shards_total": 1}
        return httpx.Response(201, json={"job": record})

    client = httpx.Client(transport=httpx.MockTransport(producer), base_url="http://producer")
    monkeypatch.setattr(jobs, "api_client", lambda settings: client)
    args = root.parse_args(["summarize", "regen-1", "--words", "20", "--job-id", "sum-1"])
    args.func(args, Settings())
    assert posted == [{"kind": "summarize", "source_job_id": "regen-1", "max_words": 20, "job_id": "sum-1"}]
    assert "submitted sum-1: 4 samples (0 rejected), 80 tokens, 1 shards" in capsys.readouterr().out


def test_a_kind_whose_command_names_no_field_of_its_spec_or_another_kinds_command_is_refused() -> None:
    """(A kind without a command at all is refused like one without any declaration: test_schemas.py.)"""

    class Misspelled(Summarize):
        name = "misspelled"
        command = KindCommand(help="x", flags={"max_wrds": ("--words",)})

    class Shadowing(Summarize):
        name = "shadowing"
        command = KindCommand(help="x", name="submit")

    with pytest.raises(TypeError, match="'misspelled': its command names max_wrds, not fields of its spec"):
        registry([Misspelled()])
    with pytest.raises(TypeError, match="job kinds 'extract' and 'shadowing' share the command 'submit'"):
        registry([*KINDS.values(), Shadowing()])


def finished(job_id: str, kind: str) -> dict[str, Any]:
    """A finished job's progress as the API answers it."""
    counts = ("samples_total", "samples_done", "tokens_total", "tokens_done", "shards_total", "shards_committed")
    zeros = ("samples_rejected", "samples_failed", "tokens_failed", "shards_dead_lettered", "bytes_stored")
    return {
        **dict.fromkeys(counts, 2),
        **dict.fromkeys(zeros, 0),
        "job_id": job_id,
        "kind": kind,
        "state": "completed",
        "bytes_per_token": 0.0,
        "projected_total_bytes": 0,
        "storage_budget_bytes": None,
        "budget_headroom_bytes": None,
        "tokens_per_second": 1.0,
        "eta_seconds": None,
        "elapsed_seconds": 1.0,
        "created_at": "2026-01-01T00:00:00Z",
    }


@pytest.mark.parametrize("as_json", [False, True])
def test_the_audit_command_prints_its_report_and_fails_with_the_audit(
    as_json: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    failure = {
        "sample_index": 1,
        "sample_id": "s-7",
        "source_index": 7,
        "source_shard": 0,
        "passed": False,
        "aux_errors": [1.0, None, None],
        "final_error": None,
        "nearest_aux": [None, 1, 2],
        "reasons": ["aux 0: relative error 1.0000 > 0.05"],
    }
    report = {
        "source_job_id": "src-1",
        "audit_job_id": "aud-1",
        "finished_at": "2026-01-01T00:00:01Z",
        "backend": {"url": "http://reference:30000", "backend": "reference", "version": "1"},
        "source_backend": {"backend": "sglang", "version": "0.5"},
        "independent": True,
        "storage_dtype": "bfloat16",
        "tolerances": {"aux": 0.05, "final": 0.08},
        "aux_layer_ids": [1, 3, 5],
        "samples_checked": 2,
        "samples_failed": 1,
        "passed": False,
        "layers": [{"name": "final", "median": 0.01, "worst": None}],
        "failures": [failure],
    }
    record = {"job_id": "aud-1", "samples_total": 2, "spec": {"source_job_id": "src-1", "audit_backend_url": None}}
    answers = {
        ("POST", "/v1/jobs"): {"job": record},
        ("GET", "/v1/jobs/aud-1/progress"): finished("aud-1", "audit"),
        ("GET", "/v1/jobs/src-1/audit"): report,
    }
    posted: list[dict] = []

    def producer(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            posted.append(json.loads(request.content))
        return httpx.Response(200, json=answers[(request.method, request.url.path)])

    client = httpx.Client(transport=httpx.MockTransport(producer), base_url="http://producer")
    monkeypatch.setattr(jobs, "api_client", lambda settings: client)
    args = parser().parse_args(["audit", "src-1", "--samples", "2", *(["--json"] if as_json else [])])
    with pytest.raises(SystemExit, match="audit of src-1 failed: 1 samples"):
        args.func(args, Settings())
    assert posted == [{"kind": "audit", "source_job_id": "src-1", "audit_samples": 2}]
    out = capsys.readouterr()
    if as_json:  # stdout holds the report alone; the rest went to stderr
        assert json.loads(out.out) == report and "submitted audit aud-1 of src-1" in out.err
    else:
        words = " ".join(out.out.split())  # the table wraps its title and caption to its width
        assert "submitted audit aud-1 of src-1: 2 samples recomputed by the reference server" in words
        assert "audit aud-1 of src-1: FAILED, 2 samples checked, 1 failed" in words
        assert "│ s-7 │" in words and "aux 0: relative error 1.0000 > 0.05" in words

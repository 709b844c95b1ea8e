"""A kind's command offers the options its declaration names (KindOptions), by the flags the declaration gives them,
and not the ones the command takes another way."""

import argparse

import pytest

from eagle3 import jobs


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="eagle3")
    jobs.add_parsers(root.add_subparsers(dest="command"))
    return root


def test_the_audit_command_offers_its_declared_options_by_their_flags() -> None:
    args = parser().parse_args(["audit", "job-1", "--samples", "3", "--backend", "reference", "--seed", "2"])
    assert (args.source_job_id, args.audit_samples, args.audit_backend_url, args.seed) == ("job-1", 3, "reference", 2)
    with pytest.raises(SystemExit):  # the source job is the positional JOB, not a flag
        parser().parse_args(["audit", "job-1", "--source-job-id", "job-2"])


def test_the_regenerate_command_takes_its_output_as_out() -> None:
    args = parser().parse_args(["regenerate", "chats.jsonl", "--out", "regenerated.jsonl", "--max-new-tokens", "9"])
    assert (args.out, args.max_new_tokens) == ("regenerated.jsonl", 9)
    with pytest.raises(SystemExit):
        parser().parse_args(["regenerate", "chats.jsonl", "--output-url", "x"])

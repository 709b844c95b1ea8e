"""pytest plugin for `make faults` (`-p tests.faults.report`): one table row per fault scenario, printed at the end
and written to build/faults.json.

A scenario records its row through the `fault_table` fixture (tests/faults/conftest.py); the row's result is the
test's outcome. Scenarios tested elsewhere (the trainer's resume, the audit of corrupted stored states) get a row from
their test's outcome, and the audit's verdict as its note where the test records one.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from tests.faults.audit import Audit

REPORT_PATH = Path("build/faults.json")
AUDIT_TEST = "tests/integration/test_audit.py"
CORRUPTED_STATES = f"{AUDIT_TEST}::test_corrupted_samples_are_flagged_by_sample_and_defect"
# Fault scenarios whose test lives with the code it covers. The stored data's rows are one extraction job each, one
# sample of it made wrong after its commit and its manifest rewritten to match, so only the audit's recomputation can
# tell; their tests record the audit's verdict (the user property "audit"), which becomes the row's note.
EXTERNAL_SCENARIOS = {
    "tests/trainer/test_train.py::test_resume_reproduces_the_uninterrupted_run": (
        "trainer stopped mid-epoch, --resume continues exactly"
    ),
    f"{AUDIT_TEST}::test_a_clean_job_passes_with_every_sample_checked": (
        "stored states as extracted: the audit checks every sample, passes"
    ),
    f"{CORRUPTED_STATES}[zeroed-layer]": "stored states, an aux layer of one sample zeroed: the audit names it",
    f"{CORRUPTED_STATES}[swapped-layers]": "stored states, two aux layers of one sample swapped: the audit names it",
    f"{CORRUPTED_STATES}[another-samples-final]": (
        "stored states, one sample's final state taken from another: the audit names it"
    ),
    f"{CORRUPTED_STATES}[another-jobs-sample]": (
        "stored states, one sample's file replaced by another job's: the audit names it"
    ),
}
AUDIT_PROPERTY = "audit"


@dataclass
class Row:
    scenario: str
    audit: Audit | None = None
    recover_s: float | None = None
    reruns: int | None = None
    note: str = ""
    outcome: str = "not run"
    extra: dict[str, float] = field(default_factory=dict)


ROWS: dict[str, Row] = {}


def record(nodeid: str, row: Row) -> None:
    ROWS[nodeid] = row


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    report = yield
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        row = ROWS.get(item.nodeid)
        if row is None and item.nodeid in EXTERNAL_SCENARIOS:
            folder = item.nodeid.split("::")[0].rsplit("/", 1)[0]
            row = ROWS[item.nodeid] = Row(EXTERNAL_SCENARIOS[item.nodeid], note=folder)
        if row is not None:
            row.outcome = report.outcome
            row.note = str(dict(report.user_properties).get(AUDIT_PROPERTY, row.note))
    return report


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not ROWS:
        return
    header = ["scenario", "expected", "once", "dup", "lost", "torn", "stray", "recover s", "re-runs", "result"]
    lines = []
    for row in ROWS.values():
        a = row.audit
        lines.append(
            [
                row.scenario,
                _cell(a and a.samples_expected),
                _cell(a and a.committed_once),
                _cell(a and a.duplicated),
                _cell(a and a.lost),
                _cell(a and len(a.torn)),
                _cell(a and len(a.stray)),
                _cell(row.recover_s),
                _cell(row.reruns),
                row.outcome,
            ]
        )
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    terminalreporter.section("fault table")
    for r in [header, ["-" * w for w in widths], *lines]:
        terminalreporter.write_line(
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        )
    terminalreporter.write_line(
        "recover s: from the fault to the affected shard running again (worker kills), to the last shard enqueued "
        "(producer killed mid-enqueue), or to the next commit (other faults; from the end of a fault that lasts)"
    )
    for row in ROWS.values():
        if row.note:
            terminalreporter.write_line(f"- {row.scenario}: {row.note}")
    REPORT_PATH.parent.mkdir(parents=True, exist_ok=True)
    REPORT_PATH.write_text(json.dumps([asdict(r) for r in ROWS.values()], indent=1, default=str))
    terminalreporter.write_line(f"written to {REPORT_PATH}")

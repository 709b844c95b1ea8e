"""A job kind's command, `eagle3 <command>`, as the kind declares it (`JobKind.command`) and the command line builds
it (eagle3/jobs.py, one subcommand per registered kind): which arguments set which fields of the spec, and what the
command shows once its job is submitted (`JobKind.follow`, against a `CommandSession`). Plain data and a protocol:
the command line talks only to the producer API, and reads these without loading torch or a kind's work."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

from shared.lifecycle.schemas import Progress

# The common fields of a spec that an extraction reads: the options of a command that submits one (`eagle3 submit`, or
# `eagle3 regenerate`, whose extraction job follows it).
EXTRACTION_OPTIONS = (
    "model_path",
    "job_id",
    "max_length",
    "length_policy",
    "draft_vocab_size",
    "shard_token_budget",
    "shard_seconds",
    "storage_dtype",
)


@dataclass(frozen=True)
class Positional:
    """A positional argument of a kind's command, which sets one field of the spec (the kind's or a common one)."""

    field: str
    metavar: str | None = None
    help: str | None = None  # none: the field's description


@dataclass(frozen=True)
class KindCommand:
    """How `eagle3 <name>` submits a job of a kind. The command takes, besides what is declared here, every option of
    the kind (its KindOptions fields) as `--field-name`; a kind that reads a dataset (`reads_dataset`) also takes the
    dataset, a path or URL, first, and `--upload` to send the file itself."""

    help: str  # the line `eagle3 --help` shows
    name: str = ""  # the subcommand; empty: the kind's name
    description: str | None = None  # what `eagle3 <name> --help` says beneath the usage
    positionals: tuple[Positional, ...] = ()  # after the dataset, if the kind reads one
    common_options: tuple[str, ...] = ()  # JobSpec's common fields it offers, as --field-name (--model for model_path)
    # Option fields offered under other flags than --field-name (`--samples` for audit_samples).
    flags: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Fields naming a file on the caller's machine or a URL: sent as an absolute path, since the producer runs
    # elsewhere and reads it from there.
    local_paths: tuple[str, ...] = ()
    watch_help: str | None = None  # offers --watch (CommandSession.watching), with this help
    # Offers --json: `follow` gives a result (CommandSession.result) that is then printed as JSON, alone on stdout.
    json_result: bool = False

    def fields(self) -> Sequence[str]:
        """The spec fields this declaration names, which the kind's options or JobSpec must have (the registry
        checks)."""
        return [*(p.field for p in self.positionals), *self.common_options, *self.flags, *self.local_paths]


@dataclass(frozen=True)
class ResultTable:
    """A table a command prints: console markup ([bold]...[/], [red]...[/]) allowed in every text."""

    title: str
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]]
    caption: str = ""
    numeric: tuple[str, ...] = ()  # the columns aligned right


class CommandSession(Protocol):
    """What a kind's command can do once its job is submitted, as the command line gives it: the producer API and the
    terminal."""

    @property
    def watching(self) -> bool:
        """Whether --watch was given."""

    def say(self, markup: str) -> None:
        """A line for the user (console markup); on stderr when the result is printed as JSON."""

    def watch(self, job_id: str) -> Progress:
        """A live progress bar until the job finishes; its last progress."""

    def show_progress(self, progress: Progress) -> None:
        """The progress table `eagle3 status` prints."""

    def get(self, path: str) -> Any | None:
        """The producer API's answer to GET `path` (JSON), None when it answers 404."""

    def result(self, data: Mapping[str, Any], table: ResultTable) -> None:
        """What the command found: printed as JSON with --json, else as the table."""

    def fail(self, message: str) -> NoReturn:
        """End the command with this message and exit status 1."""

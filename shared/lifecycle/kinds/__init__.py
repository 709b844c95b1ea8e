"""The job kinds, by the name a JobSpec gives (`kind`). A new kind is a new module here and one line below."""

from collections.abc import Iterable

from shared.errors import SubmitError
from shared.lifecycle.kind import JobKind
from shared.lifecycle.kinds.audit import Audit, AuditVerdict
from shared.lifecycle.kinds.extract import Extract
from shared.lifecycle.kinds.regenerate import Regenerate
from shared.lifecycle.progress import KIND_PROGRESS
from shared.lifecycle.schemas import KIND_OPTIONS, KIND_RECORDS, JobSpec


def registry(kinds: Iterable[JobKind]) -> dict[str, JobKind]:
    """The kinds by name. A kind that leaves out a declaration (JobKind.DECLARATIONS), reuses a name or a command's
    name, or whose command names a field that neither its options nor JobSpec have, fails here, at import, rather than
    when its first job (or its command) reaches the code that reads the missing piece."""
    found: dict[str, JobKind] = {}
    commands: dict[str, JobKind] = {}
    for kind in kinds:
        missing = [name for name in JobKind.DECLARATIONS if not hasattr(type(kind), name)]
        if missing:
            raise TypeError(f"job kind {type(kind).__name__} does not declare {', '.join(missing)} (JobKind says what)")
        if kind.name in found:
            twice = f"{type(found[kind.name]).__name__} and {type(kind).__name__}"
            raise TypeError(f"job kind {kind.name!r} is declared twice: {twice}")
        unknown = [
            name
            for name in kind.command.fields()
            if name not in kind.options.model_fields and name not in JobSpec.model_fields
        ]
        if unknown:
            raise TypeError(f"job kind {kind.name!r}: its command names {', '.join(unknown)}, not fields of its spec")
        if kind.command_name in commands:
            raise TypeError(
                f"job kinds {commands[kind.command_name].name!r} and {kind.name!r} share the command "
                f"{kind.command_name!r}"
            )
        found[kind.name] = kind
        commands[kind.command_name] = kind
    return found


def register(kinds: dict[str, JobKind]) -> None:
    """Make the kinds the ones a JobSpec names, with their options; a JobRecord's kind fields and a job's progress
    theirs."""
    KIND_OPTIONS.clear()
    KIND_OPTIONS.update({name: kind.options for name, kind in kinds.items()})
    KIND_RECORDS.clear()
    KIND_RECORDS.update({name: kind.record for name, kind in kinds.items()})
    KIND_PROGRESS.clear()
    KIND_PROGRESS.update({name: kind.progress for name, kind in kinds.items()})


AUDIT = Audit()  # also asked for a job's last audit (last_report, last_verdict: an AuditVerdict)
KINDS = registry((Extract(), Regenerate(), AUDIT))
register(KINDS)
EXTRACT, REGENERATE = KINDS["extract"], KINDS["regenerate"]
__all__ = ["AUDIT", "EXTRACT", "KINDS", "REGENERATE", "AuditVerdict", "kind_of", "register", "registry"]


def kind_of(name: str) -> JobKind:
    try:
        return KINDS[name]
    except KeyError:
        raise SubmitError(f"job kind {name!r}: not one of {sorted(KINDS)}") from None

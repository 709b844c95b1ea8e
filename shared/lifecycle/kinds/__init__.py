"""The job kinds, by the name a JobSpec gives (`kind`). A new kind is a new module here and one line below."""

from shared.errors import SubmitError
from shared.lifecycle.kind import JobKind
from shared.lifecycle.kinds.audit import Audit
from shared.lifecycle.kinds.extract import Extract
from shared.lifecycle.kinds.regenerate import Regenerate

AUDIT = Audit()  # also asked for a job's last audit (last_report)
KINDS: dict[str, JobKind] = {kind.name: kind for kind in (Extract(), Regenerate(), AUDIT)}
EXTRACT, REGENERATE = KINDS["extract"], KINDS["regenerate"]


def kind_of(name: str) -> JobKind:
    try:
        return KINDS[name]
    except KeyError:
        raise SubmitError(f"job kind {name!r}: not one of {sorted(KINDS)}") from None

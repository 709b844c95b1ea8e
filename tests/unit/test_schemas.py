"""job.json refuses a key it does not know, naming it, and still reads every job.json an earlier version wrote."""

import json

import pytest
from pydantic import BaseModel, ValidationError

from shared.lifecycle.command import KindCommand
from shared.lifecycle.kind import JobKind, KindOptions, KindRecord
from shared.lifecycle.kinds import KINDS, registry
from shared.lifecycle.kinds.extract import Extract
from shared.lifecycle.kinds.regenerate import RegenerateRecord, RegenerationPlan
from shared.lifecycle.schemas import LEGACY_OPTION_DEFAULTS, JobRecord, JobSpec
from tests.integration.test_progress import make_job

# What each version added since the first job.json (commit 3cb05d1); nothing was ever removed or renamed.
ADDED_TO_THE_SPEC = ("storage_dtype", "shard_seconds")  # 7035909 (fp8 storage), e93e577 (shards sized in seconds)
ADDED_TO_THE_RECORD = ("provenance",)  # 81a51a2


def job_json(**spec: object) -> dict:
    """A job.json as this version writes it."""
    job = make_job(shards=1).model_copy(update={"spec": JobSpec(dataset_url="/x.jsonl", **spec)})
    written = json.loads(job.model_dump_json()) | {"versions": {"eagle3": "0.1.0"}}
    if spec.get("kind") == "regenerate":  # the regenerate kind's own field (its KindRecord)
        plan = RegenerationPlan(
            assistant_turns_total=1,
            max_generated_tokens=8,
            sampling_params={"max_new_tokens": 8, "temperature": 0.0},
            output_key="job-a/regenerated.jsonl",
            tokenizer_prefix="job-a/tokenizer/",
        )
        written["regeneration"] = plan.model_dump()
    return written


@pytest.mark.parametrize("kind", ["extract", "regenerate"])
def test_a_job_json_of_the_first_version_still_reads(kind: str) -> None:
    first = job_json(kind=kind)
    for name in ADDED_TO_THE_SPEC:
        del first["spec"][name]
    for name in ADDED_TO_THE_RECORD:
        del first[name]
    job = JobRecord.model_validate_json(json.dumps(first))
    assert (job.kind, job.spec.storage_dtype, job.spec.shard_seconds, job.provenance) == (kind, "bfloat16", None, None)


@pytest.mark.parametrize("kind", ["extract", "regenerate"])
def test_a_job_json_of_the_flat_spec_still_reads(kind: str) -> None:
    """Before each kind declared its options, every job.json held every kind's, at their defaults when not asked."""
    flat = job_json(kind=kind)
    flat["spec"] = {**LEGACY_OPTION_DEFAULTS, **flat["spec"]}
    if kind == "regenerate":
        flat["spec"] |= {"max_new_tokens": 9, "then_extract": True}
    job = JobRecord.model_validate_json(json.dumps(flat))
    if kind == "extract":
        assert job.spec.model_extra == {}  # nothing an extraction takes
    else:
        extra = job.spec.model_extra or {}
        assert (extra["max_new_tokens"], extra["then_extract"], "audit_samples" in extra) == (9, True, False)
    # A flat key away from its default is not another kind's leftover: it is refused.
    flat["spec"]["audit_samples"] = 5
    with pytest.raises(ValidationError, match=rf"spec.audit_samples\n  not an option of jobs of kind '{kind}'"):
        JobRecord.model_validate_json(json.dumps(flat))


def test_this_versions_job_json_reads_back_whole() -> None:
    written = job_json(kind="regenerate", then_extract=True, seed=3)
    job = JobRecord.model_validate(written)
    assert json.loads(job.model_dump_json()) == written
    assert RegenerateRecord.plan_of(job).max_generated_tokens == 8  # the kind reads its own fields typed


def test_a_kinds_own_record_fields_are_its_alone() -> None:
    """Every job.json of earlier versions held `regeneration` (null but for regenerate jobs): it still reads; now only
    the kind that declares the field may hold it, and that kind must."""
    extract = job_json(kind="extract")
    assert "regeneration" not in extract
    assert JobRecord.model_validate(extract | {"regeneration": None}).model_extra == {}
    with pytest.raises(ValidationError, match=r"regeneration\n  Extra inputs are not permitted"):
        JobRecord.model_validate(extract | {"regeneration": job_json(kind="regenerate")["regeneration"]})
    regenerate = job_json(kind="regenerate")
    del regenerate["regeneration"]
    with pytest.raises(ValidationError, match=r"regeneration\n  Field required"):
        JobRecord.model_validate(regenerate)


@pytest.mark.parametrize(
    ("where", "loc"),
    [
        pytest.param((), "shards_planned", id="record"),
        pytest.param(("model",), "model.num_layers", id="model"),
        pytest.param(("regeneration",), "regeneration.chained_job", id="regeneration-plan"),
    ],
)
def test_an_unknown_key_in_a_job_json_is_refused_by_name(where: tuple[str, ...], loc: str) -> None:
    written = job_json(kind="regenerate")
    part = written
    for name in where:
        part = part[name]
    part[loc.rpartition(".")[2]] = 1
    with pytest.raises(ValidationError, match=rf"{loc}\n  Extra inputs are not permitted"):
        JobRecord.model_validate_json(json.dumps(written))


def test_an_unknown_field_of_a_spec_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match=r"max_lenght\n  not an option of jobs of kind 'extract'"):
        JobSpec.model_validate({"dataset_url": "-", "max_lenght": 512})
    with pytest.raises(ValidationError, match=r"shard_token_budjet\n  not an option of jobs of kind 'regenerate'"):
        JobSpec.model_validate({"kind": "regenerate", "shard_token_budjet": 512})
    # Another kind's option is not this kind's either; a bad value names the option and the kind.
    with pytest.raises(ValidationError, match=r"then_extract\n  not an option of jobs of kind 'extract'"):
        JobSpec.model_validate({"then_extract": True})
    with pytest.raises(ValidationError, match=r"max_new_tokens\n  Input should be greater than or equal to 1"):
        JobSpec.model_validate({"kind": "regenerate", "max_new_tokens": 0})
    with pytest.raises(
        ValidationError,
        match=r"kind\n  not one of audit, extract, regenerate \[type=unknown_kind",
    ):
        JobSpec.model_validate({"kind": "summarize"})


def test_a_kinds_options_are_recorded_with_their_defaults_and_read_typed() -> None:
    spec = JobSpec.model_validate({"kind": "regenerate", "then_train": True})
    options = KINDS["regenerate"].options.of(spec)
    assert (options.then_train, options.then_extract) == (True, True)  # then_train implies it
    assert spec.model_dump()["max_new_tokens"] == 2048 and spec.model_dump()["then_extract"] is True
    assert JobSpec.model_validate(spec.model_dump()) == spec


def test_every_kind_in_the_registry_is_declared_whole() -> None:
    """A kind added to the registry without its declaration fails here, not at a worker: its name in JobSpec.kind,
    its input and manifest models, and counters that progress can zero and recount."""
    for name, kind in KINDS.items():
        assert kind.name == name
        assert issubclass(kind.options, KindOptions) and isinstance(kind.finalizes, bool)
        assert issubclass(kind.record, KindRecord)
        assert isinstance(kind.command, KindCommand) and kind.command.help
        assert issubclass(kind.input_type, BaseModel) and issubclass(kind.manifest_type, BaseModel)
        assert all(isinstance(counter, str) and help_text for counter, help_text in kind.counters.items())
        if "counters" not in kind.manifest_type.model_fields:
            assert not kind.counters, f"{name} declares counters its manifests cannot carry"


def test_a_kind_without_its_declarations_is_refused_when_registered() -> None:
    class Summarize(JobKind):  # a new kind whose author wrote the work and forgot the declarations
        def plan(self, *args: object) -> None: ...

        open = prepare = items = item_key = reuse = process = plan

    declarations = "name, input_type, manifest_type, options, record, finalizes, command"
    with pytest.raises(TypeError, match=f"Summarize does not declare {declarations}"):
        registry([Summarize()])
    with pytest.raises(TypeError, match="job kind 'extract' is declared twice"):
        registry([Extract(), Extract()])


def test_an_audit_backend_is_the_reference_server_or_a_url() -> None:
    """`--backend reference` (or none) leaves the choice to the worker: EAGLE3_REFERENCE_URL, else its own server;
    anything but an http(s) URL is refused at submit, naming the field."""
    from shared.lifecycle.kinds.audit import backend_url
    from shared.settings import Settings

    def spec(backend: str | None) -> JobSpec:
        return JobSpec(kind="audit", source_job_id="20260101-000000-abcd", audit_backend_url=backend)

    workers = Settings(inference_url="http://sglang:30000")
    beside = Settings(inference_url="http://sglang:30000", reference_url="http://reference:30000")
    for backend in (None, "reference"):
        assert spec(backend).model_dump()["audit_backend_url"] is None
        assert backend_url(spec(backend), workers) == "http://sglang:30000"
        assert backend_url(spec(backend), beside) == "http://reference:30000"
    assert backend_url(spec("https://other:8443"), beside) == "https://other:8443"
    with pytest.raises(ValidationError, match=r"audit_backend_url\n.*'sglang:30000': 'reference' or a capture"):
        spec("sglang:30000")

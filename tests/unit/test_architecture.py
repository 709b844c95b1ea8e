"""The layout is the architecture (docs/architecture.md), and these rules keep it:

- `shared/` is domain logic: it imports no service, not the composition root, and no process machinery (argparse,
  subprocess, FastAPI, uvicorn, Celery) — except the send-only shard client, which uses Celery to send and nothing else;
- a service (`services/<name>/`) never imports another service or the composition root;
- a service and the composition root look a job kind up by name in the registry (`shared.lifecycle.kinds`), never
  import a kind's own module: what differs between kinds is asked of the kind;
- only the composition root (`eagle3/`) wires several services together;
- inside `shared/`, the leaves (capture, storage, data and the top-level modules) import nothing of the job lifecycle
  or of ops, the lifecycle imports nothing of ops, and no module imports itself back through others.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROCESS_MODULES = {"argparse", "subprocess", "fastapi", "uvicorn", "celery"}
SEND_ONLY_CLIENT = Path("shared/lifecycle/queue.py")  # Celery as a message sender: no app of tasks, no worker settings
# What the leaves of shared/ may not import: they sit under the lifecycle, which sits under ops.
LIFECYCLE_AND_UP = ("shared.lifecycle", "shared.ops")
KINDS_REGISTRY = "shared.lifecycle.kinds"


def imported_modules(source: str) -> set[str]:
    """Every absolute module a source file imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def is_kind_module(name: str) -> bool:
    """`shared.lifecycle.kinds.<module>`, not a name the registry exports (`shared.lifecycle.kinds.kind_of`)."""
    module = name.removeprefix(KINDS_REGISTRY + ".").split(".")[0]
    return name.startswith(KINDS_REGISTRY + ".") and (ROOT / "shared/lifecycle/kinds" / f"{module}.py").is_file()


def violations(path: Path, source: str) -> list[str]:
    """What a module at `path` (relative to the repository root) imports against the rules."""
    found: list[str] = []
    top_dir = path.parts[0]
    for name in sorted(imported_modules(source)):
        parts = name.split(".")
        if top_dir in ("services", "eagle3") and is_kind_module(name):
            found.append(f"{path}: imports the job kind module {name} (ask the kind from shared.lifecycle.kinds)")
        if top_dir == "shared":
            if parts[0] in ("services", "eagle3"):
                found.append(f"{path}: shared imports {name}")
            elif parts[0] in PROCESS_MODULES and not (parts[0] == "celery" and path == SEND_ONLY_CLIENT):
                found.append(f"{path}: shared imports process machinery {name}")
            elif any(name == above or name.startswith(above + ".") for above in forbidden_above(path)):
                found.append(f"{path}: {shared_part(path)} imports {name}, which sits above it")
        elif top_dir == "services" and len(path.parts) > 2:
            own = path.parts[1]
            if parts[0] == "eagle3" or (parts[0] == "services" and len(parts) > 1 and parts[1] != own):
                found.append(f"{path}: service {own} imports {name}")
    return found


def shared_part(path: Path) -> str:
    """The package of shared/ a module belongs to; "leaf" for the top-level modules (settings, errors, access...)."""
    return path.parts[1] if len(path.parts) > 2 else "leaf"


def forbidden_above(path: Path) -> tuple[str, ...]:
    part = shared_part(path)
    if part == "lifecycle":
        return ("shared.ops",)
    if part == "ops":
        return ()
    return LIFECYCLE_AND_UP


def import_graph() -> dict[str, set[str]]:
    """shared's modules and the shared modules each imports (at the top or inside a function)."""
    files = {".".join(p.with_suffix("").parts).removesuffix(".__init__"): p for p in modules("shared")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for name in imported_modules((ROOT / path).read_text()):
            while name and name not in files:  # `from shared.x import y` names y, a module or a name in x
                name = name.rpartition(".")[0]
            if name and name != module and name != "shared":
                targets.add(name)
        graph[module] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_shared_has_no_import_circles() -> None:
    graph = import_graph()
    assert len(graph) > 30
    assert not circles(graph), circles(graph)


def test_a_circle_is_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def modules(*tops: str) -> list[Path]:
    return sorted(p.relative_to(ROOT) for top in tops for p in (ROOT / top).rglob("*.py"))


def test_the_layout_keeps_its_rules() -> None:
    checked = modules("shared", "services", "eagle3")
    found = [v for path in checked for v in violations(path, (ROOT / path).read_text())]
    services = {p.parts[1] for p in checked if p.parts[0] == "services" and len(p.parts) > 2}
    print(f"\nimport rules: {len(checked)} modules checked, services {sorted(services)}, {len(found)} violations")
    assert services >= {"producer", "worker", "inference", "trainer"}
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("path", "source"),
    [
        pytest.param(
            "shared/lifecycle/jobs.py", "from services.worker.celery_app import app", id="shared-imports-a-service"
        ),
        pytest.param("shared/lifecycle/jobs.py", "def f():\n    import subprocess\n", id="shared-spawns-processes"),
        pytest.param(
            "shared/storage/objects.py", "from celery import Celery", id="celery-outside-the-send-only-client"
        ),
        pytest.param("shared/data/demo_data.py", "import eagle3.cli", id="shared-imports-the-composition-root"),
        pytest.param("shared/storage/layout.py", "from shared.lifecycle import progress", id="leaf-imports-lifecycle"),
        pytest.param("shared/settings.py", "from shared.lifecycle.schemas import JobSpec", id="top-imports-lifecycle"),
        pytest.param("shared/capture/client.py", "from shared.ops import cluster", id="leaf-imports-ops"),
        pytest.param("shared/lifecycle/jobs.py", "from shared.ops.doctor import run", id="lifecycle-imports-ops"),
        pytest.param("services/producer/app.py", "from services.trainer import train", id="service-imports-service"),
        pytest.param(
            "services/worker/tasks.py", "from eagle3.local_stack import LocalStack", id="service-imports-root"
        ),
        pytest.param(
            "services/trainer/cli.py",
            "from shared.lifecycle.kinds.regenerate import REGENERATION_COUNTERS",
            id="service-imports-a-kind-module",
        ),
        pytest.param("eagle3/jobs.py", "from shared.lifecycle.kinds import extract", id="root-imports-a-kind-module"),
    ],
)
def test_each_rule_catches_its_violation(path: str, source: str) -> None:
    assert violations(Path(path), source)


def test_what_the_rules_allow() -> None:
    assert not violations(Path("shared/ops/doctor.py"), "from shared.lifecycle import jobs")
    assert not violations(Path("shared/lifecycle/jobs.py"), "from shared.storage import layout")
    assert not violations(SEND_ONLY_CLIENT, "from celery import Celery")
    assert not violations(Path("services/producer/app.py"), "from services.producer.deps import get_redis")
    assert not violations(Path("eagle3/cli.py"), "from services.trainer import cli\nfrom services.worker import cli")
    assert not violations(Path("services/trainer/cli.py"), "from shared.lifecycle.kinds import KINDS, kind_of")
    assert not violations(Path("shared/ops/doctor.py"), "from shared.lifecycle.kinds.extract import bytes_per_token")


def loaded_heavy_modules(code: str) -> list[str]:
    """Which of torch and transformers a fresh interpreter has loaded after running `code`."""
    code += "\nimport sys; print(' '.join(m for m in ('torch', 'transformers') if m in sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return run.stdout.split()


def test_the_command_line_starts_without_torch() -> None:
    """Every process of the stack starts through `eagle3` (workers, the API): its parser must not import torch or
    transformers, which the trainer's and the evaluation's modules bring (6 s instead of 0.6 s, seen when the
    engine evaluation imported them at module level and the workers' first heartbeat came too late). The parser
    reads every job kind's command from the registry, so the kinds' modules load them only where their work does."""
    assert loaded_heavy_modules("import eagle3.cli; eagle3.cli.build_parser()") == []


def test_the_registry_of_kinds_loads_no_torch() -> None:
    assert loaded_heavy_modules("import shared.lifecycle.kinds") == []

"""The layout is the architecture (docs/architecture.md), and these rules keep it:

- `shared/` is domain logic: it imports no service, not the composition root, and no process machinery (argparse,
  subprocess, FastAPI, uvicorn, Celery) — except the send-only shard client, which uses Celery to send and nothing else;
- a service (`services/<name>/`) never imports another service or the composition root;
- only the composition root (`eagle3/`) wires several services together.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROCESS_MODULES = {"argparse", "subprocess", "fastapi", "uvicorn", "celery"}
SEND_ONLY_CLIENT = Path("shared/lifecycle/queue.py")  # Celery as a message sender: no app of tasks, no worker settings


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


def violations(path: Path, source: str) -> list[str]:
    """What a module at `path` (relative to the repository root) imports against the rules."""
    found: list[str] = []
    top_dir = path.parts[0]
    for name in sorted(imported_modules(source)):
        parts = name.split(".")
        if top_dir == "shared":
            if parts[0] in ("services", "eagle3"):
                found.append(f"{path}: shared imports {name}")
            elif parts[0] in PROCESS_MODULES and not (parts[0] == "celery" and path == SEND_ONLY_CLIENT):
                found.append(f"{path}: shared imports process machinery {name}")
        elif top_dir == "services" and len(path.parts) > 2:
            own = path.parts[1]
            if parts[0] == "eagle3" or (parts[0] == "services" and len(parts) > 1 and parts[1] != own):
                found.append(f"{path}: service {own} imports {name}")
    return found


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
        pytest.param("services/producer/app.py", "from services.trainer import train", id="service-imports-service"),
        pytest.param(
            "services/worker/tasks.py", "from eagle3.local_stack import LocalStack", id="service-imports-root"
        ),
    ],
)
def test_each_rule_catches_its_violation(path: str, source: str) -> None:
    assert violations(Path(path), source)


def test_what_the_rules_allow() -> None:
    assert not violations(SEND_ONLY_CLIENT, "from celery import Celery")
    assert not violations(Path("services/producer/app.py"), "from services.producer.deps import get_redis")
    assert not violations(Path("eagle3/cli.py"), "from services.trainer import cli\nfrom services.worker import cli")


def test_the_command_line_starts_without_torch() -> None:
    """Every process of the stack starts through `eagle3` (workers, the API): its parser must not import torch or
    transformers, which the trainer's and the evaluation's modules bring (6 s instead of 0.6 s, seen when the
    engine evaluation imported them at module level and the workers' first heartbeat came too late)."""
    code = "import sys, eagle3.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"

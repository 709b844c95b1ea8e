"""The container files, read statically (no Docker engine here): pinned base, plugin entry point, non-root."""

import re
import tomllib
from pathlib import Path

from eagle3_sglang_plugin import SGLANG_VERSION

PLUGIN_ROOT = Path(__file__).resolve().parents[2] / "services" / "inference" / "sglang"
REPO_ROOT = PLUGIN_ROOT.parents[2]


def dockerfile() -> str:
    return (PLUGIN_ROOT / "Dockerfile").read_text()


def test_the_base_image_is_the_sglang_release_the_hooks_were_read_at() -> None:
    match = re.search(r"^ARG SGLANG_IMAGE=lmsysorg/sglang:v(\S+)$", dockerfile(), re.MULTILINE)

    assert match is not None and match.group(1) == SGLANG_VERSION
    assert re.search(r"^FROM \$\{SGLANG_IMAGE\}$", dockerfile(), re.MULTILINE)


def test_the_plugin_registers_under_sglangs_plugin_group() -> None:
    project = tomllib.loads((PLUGIN_ROOT / "pyproject.toml").read_text())

    entry_points = project["project"]["entry-points"]["sglang.srt.plugins"]
    assert entry_points == {"eagle3_capture": "eagle3_sglang_plugin.hooks:register"}


def test_the_image_runs_as_a_user_through_the_one_entry_point() -> None:
    text = dockerfile()
    users = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
    entrypoint = PLUGIN_ROOT / "entrypoint.sh"

    assert users and users[-1] not in {"root", "0"}
    assert 'ENTRYPOINT ["/opt/eagle3/sglang-plugin/entrypoint.sh"]' in text
    assert entrypoint.stat().st_mode & 0o111, "entrypoint.sh must be executable"
    assert "exec python3 -m eagle3_sglang_plugin.launch" in entrypoint.read_text()
    assert "HEALTHCHECK" in text and "/health" in text


def test_every_copied_path_exists_in_the_build_context() -> None:
    sources = re.findall(r"^COPY (\S+) \S+$", dockerfile(), re.MULTILINE)

    assert sources == ["shared", "services/inference/sglang"]
    assert all((REPO_ROOT / source).is_dir() for source in sources)

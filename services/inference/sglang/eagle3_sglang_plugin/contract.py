"""What the plugin needs from SGLang's source, checked by reading it (AST) rather than importing it.

    python -m eagle3_sglang_plugin.contract [PATH_TO_THE_sglang_PACKAGE]

Importing SGLang needs its CUDA stack; reading it does not, so this runs anywhere: against an unpacked
`sglang` wheel on a CPU machine, and inside the image at build time (the Dockerfile runs it against the
installed package and fails the build when a hook target moved). Every entry names a file relative to the
`sglang` package and what the plugin relies on there: the five hook targets with the parameters the hooks
receive, the fields the plugin reads or writes, and the launch flags (as `ServerArgs` field names).
"""

import ast
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from .launch import launch_argv


@dataclass(frozen=True)
class Signature:
    """A function or method whose parameters include `params` (in order) and `kwonly` (keyword-only)."""

    file: str
    qualname: str  # "function" or "Class.method"
    params: tuple[str, ...] = ()
    kwonly: tuple[str, ...] = ()


@dataclass(frozen=True)
class Fields:
    """Names a class defines: annotated class attributes or `self.<name> =` assignments in its methods."""

    file: str
    cls: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class ModuleNames:
    """Names a module assigns or defines at top level."""

    file: str
    names: tuple[str, ...]


CONTRACT: list[Signature | Fields | ModuleNames] = [
    # The plugin framework.
    ModuleNames("srt/plugins/__init__.py", ("GENERAL_PLUGINS_GROUP", "load_plugins")),
    Signature("srt/plugins/hook_registry.py", "HookRegistry.register", ("cls", "target", "hook", "hook_type")),
    # Hook 1: the HTTP layer.
    Signature("srt/entrypoints/http_server.py", "_setup_and_run_http_server", ("server_args", "tokenizer_manager")),
    ModuleNames("srt/entrypoints/http_server.py", ("app", "model_info")),
    Signature("srt/managers/tokenizer_manager.py", "TokenizerManager.generate_request", ("self", "obj", "request")),
    Fields(
        "srt/managers/tokenizer_manager.py", "TokenizerManager", ("model_config", "context_len", "num_reserved_tokens")
    ),
    Fields(
        "srt/managers/io_struct.py",
        "GenerateReqInput",
        ("input_ids", "rid", "extra_key", "sampling_params", "return_hidden_states", "stream"),
    ),
    Fields(
        "srt/sampling/sampling_params.py",
        "SamplingParams",
        (
            "max_new_tokens",
            "temperature",
            "top_p",
            "top_k",
            "stop_token_ids",
            "skip_special_tokens",
            "sampling_seed",
            "custom_params",
        ),
    ),
    # Hook 2: the post-norm states' copy under the overlap scheduler.
    Signature("srt/managers/utils.py", "GenerationBatchResult.copy_to_cpu", ("self", "return_logprob")),
    Signature("srt/utils/common.py", "async_d2h", ("tensor",)),
    Fields("srt/layers/logits_processor.py", "LogitsProcessorOutput", ("hidden_states", "last_hidden_states")),
    # Hook 3: the per-request rows.
    Signature(
        "srt/managers/scheduler_components/batch_result_processor.py",
        "SchedulerBatchResultProcessor._append_prefill_hidden_states",
        ("self",),
        ("req", "logits_output", "hidden_state_offset", "capture_hidden_mode", "extend_input_len", "store"),
    ),
    Fields(
        "srt/managers/schedule_batch.py",
        "Req",
        ("rid", "origin_input_ids", "sampling_params", "customized_info", "hidden_states"),
    ),
    Signature("srt/runtime_context.py", "get_parallel"),
    Signature("srt/runtime_context.py", "get_exec"),
    Signature("srt/runtime_context.py", "get_serving"),
    # Hook 4: the meta_info key, once per request.
    Signature("srt/managers/scheduler.py", "Scheduler.get_output_streamer_class", ("self",)),
    Signature(
        "srt/managers/tokenizer_manager.py",
        "TokenizerManager.update_request_meta_info",
        ("self", "meta_info", "state", "customized_info", "index"),
    ),
    Signature(
        "srt/managers/scheduler_components/output_streamer.py",
        "SchedulerOutputStreamer.is_request_level_customized_info_key",
        ("self", "key"),
    ),
    # Aux capture on the target (the stock flags' machinery).
    Signature("srt/models/llama.py", "LlamaForCausalLM.set_eagle3_layers_to_capture", ("self", "layer_ids")),
    Signature("srt/arg_groups/validation_hook.py", "handle_aux_hidden_state_capture", ("server_args",)),
]

# The launch flags' ServerArgs fields: annotated names in arg_groups/fields/*.py.
FIELDS_DIR = "srt/arg_groups/fields"
EXTRA_FIELDS = ("aux_hidden_state_capture", "tokenizer_worker_num")  # read by the hooks, not passed as flags


def launch_fields() -> list[str]:
    """The ServerArgs field behind every flag the launcher passes (for a 32-layer model)."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps({"num_hidden_layers": 32}))
        # Every optional flag switched on, so that each is checked.
        environ = {
            "EAGLE3_MODEL_PATH": model_dir,
            "EAGLE3_SGLANG_MEM_FRACTION_STATIC": "0.8",
            "EAGLE3_SGLANG_DETERMINISTIC_INFERENCE": "1",
        }
        argv = launch_argv(environ)
    return [arg[2:].replace("-", "_") for arg in argv if arg.startswith("--")]


def check(package_dir: Path) -> list[str]:
    """Every way the SGLang source at `package_dir` (the `sglang` package folder) breaks the contract."""
    trees: dict[str, ast.Module | None] = {}

    def tree(file: str) -> ast.Module | None:
        if file not in trees:
            path = package_dir / file
            trees[file] = ast.parse(path.read_text(), str(path)) if path.is_file() else None
        return trees[file]

    problems = []
    for entry in CONTRACT:
        module = tree(entry.file)
        if module is None:
            problems.append(f"{entry.file}: missing")
            continue
        if isinstance(entry, Signature):
            problems += _check_callable(module, entry)
        elif isinstance(entry, Fields):
            problems += _check_fields(module, entry)
        else:
            defined = _module_names(module)
            problems += [f"{entry.file}: no top-level {name}" for name in entry.names if name not in defined]

    field_names: set[str] = set()
    for path in sorted((package_dir / FIELDS_DIR).glob("*.py")):
        field_names |= {
            node.target.id
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        }
    for name in [*launch_fields(), *EXTRA_FIELDS]:
        if name not in field_names:
            problems.append(f"{FIELDS_DIR}: no server argument {name} (flag --{name.replace('_', '-')})")
    return problems


def _find(module: ast.Module, qualname: str) -> ast.AST | None:
    scope: list[ast.stmt] = module.body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = next(
            (
                n
                for n in scope
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name == part
            ),
            None,
        )
        if node is None:
            return None
        scope = node.body
    return node


def _check_callable(module: ast.Module, entry: Signature) -> list[str]:
    node = _find(module, entry.qualname)
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return [f"{entry.file}: no function {entry.qualname}"]
    positional = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
    kwonly = [a.arg for a in node.args.kwonlyargs]
    problems = []
    if positional[: len(entry.params)] != list(entry.params):
        problems.append(
            f"{entry.file}: {entry.qualname} parameters {positional}, expected to start {list(entry.params)}"
        )
    missing = [name for name in entry.kwonly if name not in kwonly]
    if missing:
        problems.append(f"{entry.file}: {entry.qualname} has no keyword-only {missing} (has {kwonly})")
    return problems


def _check_fields(module: ast.Module, entry: Fields) -> list[str]:
    node = _find(module, entry.cls)
    if not isinstance(node, ast.ClassDef):
        return [f"{entry.file}: no class {entry.cls}"]
    defined = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)} | {
        target.attr
        for n in ast.walk(node)
        for target in (n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else [])
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
    }
    return [f"{entry.file}: {entry.cls} has no field {name}" for name in entry.names if name not in defined]


def _module_names(module: ast.Module) -> set[str]:
    names = set()
    for node in module.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def installed_package_dir() -> Path:
    """The installed `sglang` package folder, found without importing it (that would need CUDA)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("sglang is not installed; pass the path of an unpacked sglang package")
    return Path(next(iter(spec.submodule_search_locations)))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    package_dir = Path(args[0]) if args else installed_package_dir()
    problems = check(package_dir)
    for problem in problems:
        print(f"contract: {problem}")
    n_checks = len(CONTRACT) + len(launch_fields()) + len(EXTRA_FIELDS)
    print(f"contract: {package_dir}: {n_checks} checks, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

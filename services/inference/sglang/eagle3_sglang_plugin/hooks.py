"""The SGLang-touching layer: five hooks on SGLang v0.5.23, registered by `register` (the plugin's entry point).

SGLang calls `load_plugins()` early in every process it starts (`python/sglang/srt/plugins/__init__.py`: the CLI,
`Engine._launch_subprocesses`, `run_scheduler_process`, the detokenizer), runs each `sglang.srt.plugins` entry
point, then `HookRegistry.apply_hooks()` (`python/sglang/srt/plugins/hook_registry.py`) patches the targets.
Every target below is a name of v0.5.23 and was read at that release (the `sglang-0.5.23` wheel's `sglang/` tree,
i.e. `python/sglang/` of the v0.5.23 tag); `contract.py` checks them by reading a source tree, and a different
release needs a new reading.

The request path, with the file and function of each step (all under `python/sglang/srt/`):
1. HTTP process. `entrypoints/http_server.py: _setup_and_run_http_server` (BEFORE hook `install_http_layer`)
   adds `http.CaptureMiddleware` to SGLang's FastAPI `app` before uvicorn starts. A capture request becomes a
   `GenerateReqInput` with `return_hidden_states=True` and a `CaptureTicket` in `sampling_params.custom_params`,
   and goes through `managers/tokenizer_manager.py: TokenizerManager.generate_request` like any other.
2. Model. `--enable-return-aux-hidden-states --speculative-algorithm EAGLE3 --return-aux-hidden-state-layer-ids`
   (stock flags, `arg_groups/validation_hook.py: handle_aux_hidden_state_capture`) make `ModelRunner` call
   `model.set_eagle3_layers_to_capture(ids)` at load, before CUDA-graph capture (`model_executor/
   model_runner_components/attention_backend_setup.py: configure_aux_hidden_state_capture`), and make every
   forward keep FULL hidden states: `LogitsProcessorOutput.hidden_states` = aux concatenation `[T, 3H]`,
   `.last_hidden_states` = post-norm `[T, H]` (`layers/logits_processor.py: LogitsProcessor.forward`).
3. Overlap copy. `managers/utils.py: GenerationBatchResult.copy_to_cpu` copies `hidden_states` to pinned host
   memory on the copy stream right behind the forward, but not `last_hidden_states` ("for in-process consumers").
   BEFORE hook `copy_final_hidden_states_to_cpu` queues that copy the same way, before `copy_done` is recorded.
4. Result. `managers/scheduler_components/batch_result_processor.py: SchedulerBatchResultProcessor.
   _append_prefill_hidden_states` walks each request's rows of the flattened batch. AROUND hook
   `append_prefill_hidden_states` writes a capture request's rows to the shared directory (TP rank 0 only) and
   leaves `Req.hidden_states` empty, so no JSON floats are made; other requests run the stock code.
5. Meta. The result goes into `Req.customized_info[CAPTURE_META_KEY]`; AFTER hook `output_streamer_class` on
   `managers/scheduler.py: Scheduler.get_output_streamer_class` returns a `SchedulerOutputStreamer` subclass that
   marks the key request-level, and `TokenizerManager._handle_batch_output` puts it into `meta_info` through
   `TokenizerManager.update_request_meta_info`, whose AROUND hook `update_request_meta_info` keeps the empty
   entry SGLang pads for the batch's other requests out of their `meta_info` (plain requests stay stock).

Not supported (checked or documented): pipeline parallelism (SGLang refuses aux capture with pp_size > 1),
several tokenizer workers (`--tokenizer-worker-num > 1`: each worker has its own app), the Rust HTTP frontend
(`SGLANG_RUST_SERVER=1`), speculative decoding on the same server.
"""

import functools
import logging
from pathlib import Path
from typing import Any

from . import SGLANG_VERSION, __version__
from .capture import (
    CAPTURE_META_KEY,
    CaptureTicket,
    CaptureWriter,
    capture_request,
    is_writer_rank,
    without_empty_capture_meta,
)
from .config import PluginConfig, resolve_capture_layer_ids
from .http import BackendUnavailable, CaptureMiddleware
from .protocol import ModelLimits, model_info_answer

logger = logging.getLogger(__name__)

_HTTP_SERVER = "sglang.srt.entrypoints.http_server"
_SETUP_HTTP = f"{_HTTP_SERVER}._setup_and_run_http_server"
_APPEND_PREFILL = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor._append_prefill_hidden_states"
)
_COPY_TO_CPU = "sglang.srt.managers.utils.GenerationBatchResult.copy_to_cpu"
_STREAMER_CLASS = "sglang.srt.managers.scheduler.Scheduler.get_output_streamer_class"
_UPDATE_META = "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info"


def register() -> None:
    """The `sglang.srt.plugins` entry point: register the hooks (SGLang applies them after all plugins ran)."""
    import sglang
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if sglang.__version__ != SGLANG_VERSION:
        logger.warning(
            "eagle3 capture plugin %s was written against SGLang %s, this is %s: its hook targets may have moved",
            __version__,
            SGLANG_VERSION,
            sglang.__version__,
        )
    HookRegistry.register(_SETUP_HTTP, install_http_layer, HookType.BEFORE)
    HookRegistry.register(_COPY_TO_CPU, copy_final_hidden_states_to_cpu, HookType.BEFORE)
    HookRegistry.register(_APPEND_PREFILL, append_prefill_hidden_states, HookType.AROUND)
    HookRegistry.register(_STREAMER_CLASS, output_streamer_class, HookType.AFTER)
    HookRegistry.register(_UPDATE_META, update_request_meta_info, HookType.AROUND)


@functools.cache
def _config() -> PluginConfig:
    return PluginConfig.from_env()


@functools.cache
def _writer() -> CaptureWriter:
    """The scheduler process's capture writer (its threads start with the first capture)."""
    config = _config()
    return CaptureWriter(config.shm_dir, config.capture_writers)


# ----------------------------------------------------------------------------------------------------------
# HTTP process


def install_http_layer(server_args: Any, tokenizer_manager: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE `_setup_and_run_http_server(server_args, tokenizer_manager, ...)`: add the middleware to `app`."""
    from sglang.srt.entrypoints import http_server
    from sglang.srt.runtime_context import get_serving

    if getattr(http_server.app, "eagle3_capture_installed", False):
        return
    if get_serving().tokenizer_worker_num != 1:
        logger.error("eagle3 capture needs --tokenizer-worker-num 1; capture requests will run as plain requests")
        return
    config = _config()
    config.shm_dir.mkdir(parents=True, exist_ok=True)
    http_server.app.add_middleware(CaptureMiddleware, backend=SGLangBackend(tokenizer_manager, config.shm_dir))
    http_server.app.eagle3_capture_installed = True
    logger.info("eagle3 capture %s installed: shm_dir=%s", __version__, config.shm_dir)


class SGLangBackend:
    """`http.CaptureBackend` over SGLang's `TokenizerManager` (HTTP process)."""

    def __init__(self, tokenizer_manager: Any, shm_dir: Path) -> None:
        self.tokenizer_manager = tokenizer_manager
        self.shm_dir = shm_dir

    @functools.cached_property
    def _limits(self) -> ModelLimits:
        from sglang.srt.runtime_context import get_exec

        features = get_exec().features
        if features.aux_hidden_state_capture != "eagle3":
            raise BackendUnavailable(
                "this SGLang server does not capture EAGLE-3 aux hidden states: launch it with "
                "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3 (see eagle3_sglang_plugin.launch)"
            )
        text_config = self.tokenizer_manager.model_config.hf_text_config
        num_layers = int(text_config.num_hidden_layers)
        return ModelLimits(
            num_hidden_layers=num_layers,
            hidden_size=int(text_config.hidden_size),
            vocab_size=int(text_config.vocab_size),
            # TokenizerManager refuses `len(input_ids) + num_reserved_tokens >= context_len`.
            max_context_length=int(self.tokenizer_manager.context_len)
            - 1
            - int(getattr(self.tokenizer_manager, "num_reserved_tokens", 0) or 0),
            capture_aux_layer_ids=resolve_capture_layer_ids(features.return_aux_hidden_state_layer_ids, num_layers),
        )

    def limits(self) -> ModelLimits:
        return self._limits

    async def generate(self, kwargs: dict[str, Any], request: Any) -> Any:
        from sglang.srt.managers.io_struct import GenerateReqInput

        return await self.tokenizer_manager.generate_request(GenerateReqInput(**kwargs), request).__anext__()

    async def model_info(self) -> dict[str, Any]:
        import sglang
        from sglang.srt.entrypoints import http_server

        stock = await http_server.model_info()
        dtype = str(self.tokenizer_manager.model_config.dtype).removeprefix("torch.")
        return model_info_answer(
            stock, self.limits(), dtype=dtype, version=__version__, sglang_version=sglang.__version__
        )


# ----------------------------------------------------------------------------------------------------------
# Scheduler process


def copy_final_hidden_states_to_cpu(
    batch_result: Any, return_logprob: bool = False, return_hidden_states: bool = True, **_: Any
) -> None:
    """BEFORE `GenerationBatchResult.copy_to_cpu`: queue the post-norm states' copy next to the aux states' copy.

    Same primitive and stream as the stock copy of `hidden_states` (`utils.common.async_d2h`, recorded by the
    `copy_done` event that `copy_to_cpu` records after this), so under the overlap scheduler the post-norm rows
    are read before the next forward can reuse their buffer.
    """
    from sglang.srt.utils.common import async_d2h

    logits_output = batch_result.logits_output
    if (
        return_hidden_states
        and logits_output is not None
        and logits_output.hidden_states is not None
        and logits_output.last_hidden_states is not None
    ):
        logits_output.last_hidden_states = async_d2h(logits_output.last_hidden_states)


def append_prefill_hidden_states(original: Any, processor: Any, **kwargs: Any) -> int:
    """AROUND `_append_prefill_hidden_states(*, req, logits_output, hidden_state_offset, capture_hidden_mode,
    extend_input_len, store=True) -> int`: the new row offset, as the stock function returns it."""
    req = kwargs["req"]
    ticket = CaptureTicket.from_custom_params(getattr(req.sampling_params, "custom_params", None))
    if ticket is None:
        return original(processor, **kwargs)

    store = kwargs.get("store", True)
    if not kwargs["capture_hidden_mode"].is_full():
        offset = original(processor, **kwargs)  # the stock offset walk for a LAST-mode batch
        if store:
            _set_capture_meta(req, {"error": "SGLang kept only the last position's hidden state (mode LAST)"})
        return offset

    start = kwargs["hidden_state_offset"]
    end = start + kwargs["extend_input_len"]
    if store and _is_writer_rank():
        logits_output = kwargs["logits_output"]
        meta = capture_request(
            writer=_writer(),
            ticket=ticket,
            rid=req.rid,
            aux_hidden_states=logits_output.hidden_states,
            last_hidden_states=logits_output.last_hidden_states,
            start=start,
            end=end,
            prompt_len=len(req.origin_input_ids),
        )
        _set_capture_meta(req, meta)
    return end


def _set_capture_meta(req: Any, meta: dict[str, Any]) -> None:
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info[CAPTURE_META_KEY] = [meta]


def _is_writer_rank() -> bool:
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return is_writer_rank(
        pp_rank=parallel.pp_rank, attn_tp_rank=parallel.attn_tp_rank, attn_cp_rank=parallel.attn_cp_rank
    )


def output_streamer_class(streamer_class: type, scheduler: Any) -> type:
    """AFTER `Scheduler.get_output_streamer_class`: the same streamer, with the capture meta request-level."""
    return _request_level_capture_meta(streamer_class)


@functools.cache
def _request_level_capture_meta(base: type) -> type:
    class Eagle3CaptureOutputStreamer(base):
        """Emits `customized_info[CAPTURE_META_KEY]` once per request, not sliced per output token."""

        __slots__ = ()

        def is_request_level_customized_info_key(self, key: str) -> bool:
            return key == CAPTURE_META_KEY or super().is_request_level_customized_info_key(key)

    return Eagle3CaptureOutputStreamer


def update_request_meta_info(
    original: Any, tokenizer_manager: Any, meta_info: dict, state: Any, customized_info: dict, index: int, *args: Any
) -> None:
    """AROUND `TokenizerManager.update_request_meta_info(meta_info, state, customized_info, index, finish_reason)`."""
    return original(
        tokenizer_manager, meta_info, state, without_empty_capture_meta(customized_info, index), index, *args
    )

"""HTTP side of the capture: a protocol request in, SGLang's `GenerateReqInput` fields out, and back again.

The request model, the request checks and the tensor hand-off are the project's (`shared/capture/protocol.py`,
the same code the reference server runs), so a worker sees the same 400s from both backends. Two differences,
both announced in `/get_model_info`:
- The capture layers are fixed when SGLang starts (`--return-aux-hidden-state-layer-ids`: SGLang arms capture at
  model load, before CUDA-graph capture), so a request must name those layers, in any order. The server lists
  them as `capture_aux_layer_ids`.
- A capture request sends `input_ids` (the container runs with `--skip-tokenizer-init`).

SGLang v0.5.23 facts used here (`python/sglang/srt/managers/io_struct.py: GenerateReqInput`,
`python/sglang/srt/managers/tokenizer_manager.py: _handle_batch_output`): `rid`, `extra_key`, `sampling_params`
and `return_hidden_states` may be lists with one entry per prompt; a batch answers a list of
`{output_ids, meta_info[, text]}`; `meta_info` carries `id`, `prompt_tokens`, `completion_tokens`,
`finish_reason` (`{"type": "length", "length": n}` or `{"type": "stop", "matched": id}`, the protocol's shapes),
and each `customized_info` key of the request (here `CAPTURE_META_KEY`, a list of one capture result).
"""

import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from shared.capture.protocol import (
    CAPTURE_FILE_SUFFIX,
    GenerateRequest,
    InvalidRequest,
    RequestLimits,
    capture_file_name,
    check_request,
    request_ids,
)

from .capture import CAPTURE_META_KEY, CaptureTicket, slot_order

BODY_SPOOL_PREFIX = ".body-"  # transport "body": hidden spool files, read back and deleted by the HTTP process


class CaptureFailed(RuntimeError):
    """SGLang ran the request but did not produce a usable capture (HTTP 500); the message says why."""


@dataclass(frozen=True)
class ModelLimits:
    """What the HTTP process checks a capture request against (SGLang's model config and launch arguments)."""

    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    max_context_length: int  # the longest prompt SGLang accepts (its context length - 1)
    capture_aux_layer_ids: list[int]  # ascending: the only layers this server captures

    def request_limits(self) -> RequestLimits:
        return RequestLimits(self.num_hidden_layers, self.vocab_size, self.max_context_length)


@dataclass(frozen=True)
class CapturePlan:
    """A checked capture request: one prompt, rid and file per entry, in request order."""

    request: GenerateRequest
    prompts: list[list[int]]
    rids: list[str]
    file_names: list[str]
    extra_keys: list[str]
    is_batch: bool
    ticket_order: tuple[int, ...]

    @property
    def aux_layer_ids(self) -> list[int]:
        assert self.request.capture is not None
        return list(self.request.capture.aux_layer_ids)

    @property
    def transport(self) -> str:
        assert self.request.capture is not None
        return self.request.capture.transport


def plan_capture(body: Any, limits: ModelLimits) -> CapturePlan:
    """Validate a `/generate` body that carries `capture`; raises InvalidRequest naming the field.

    The checks are the reference server's (`shared.capture.protocol.check_request`), plus what is SGLang's own:
    input ids only, and exactly the layers fixed at launch.
    """
    try:
        request = GenerateRequest.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest.from_validation_errors(exc.errors()) from exc
    capture = request.capture
    assert capture is not None, "plan_capture is only called for bodies with a capture field"
    if request.input_ids is None:
        raise InvalidRequest("text", "a capture request sends input_ids (this server runs with --skip-tokenizer-init)")
    if request.input_ids and isinstance(request.input_ids[0], list):
        prompts, is_batch = request.input_ids, True
    else:
        # The ignore: not a batch, so a list of ints (the validator allows no mixed lists); mypy cannot tell.
        prompts, is_batch = [request.input_ids], False  # type: ignore[list-item]
    prompts = [list(p) for p in prompts]
    check_request(prompts, is_batch, request.sampling_params, capture, limits.request_limits())
    try:
        order = slot_order(limits.capture_aux_layer_ids, capture.aux_layer_ids)
    except ValueError as exc:
        raise InvalidRequest("capture.aux_layer_ids", str(exc)) from exc

    rids = request_ids(request.rid, len(prompts), is_batch)
    if capture.transport == "shm":
        file_names = [capture_file_name(rid) for rid in rids]
        if len(set(file_names)) != len(file_names):
            raise InvalidRequest("rid", "two ids of this request map to the same capture file name")
    else:
        file_names = [f"{BODY_SPOOL_PREFIX}{uuid.uuid4().hex}{CAPTURE_FILE_SUFFIX}" for _ in rids]
    extra_keys = normalize_extra_keys(request.extra_key, len(prompts), is_batch)
    return CapturePlan(request, prompts, rids, file_names, extra_keys, is_batch, order)


def normalize_extra_keys(extra_key: str | list[str] | None, n_prompts: int, is_batch: bool) -> list[str]:
    """One prefix-cache key per prompt: the client's, else a fresh one.

    SGLang keys its prefix cache on extra_key, so a fresh key per prompt forces a full prefill: every position is
    computed and captured even when the radix cache is on.
    """
    if extra_key is None:
        return [uuid.uuid4().hex for _ in range(n_prompts)]
    if is_batch != isinstance(extra_key, list):
        raise InvalidRequest("extra_key", "give one string for a single prompt and a list for a batch")
    keys = extra_key if isinstance(extra_key, list) else [extra_key]
    if len(keys) != n_prompts:
        raise InvalidRequest("extra_key", f"{len(keys)} keys for {n_prompts} prompts")
    return keys


def sglang_generate_kwargs(plan: CapturePlan) -> dict[str, Any]:
    """Keyword arguments of SGLang's `GenerateReqInput` for the plan (lists: one entry per prompt)."""
    params = plan.request.sampling_params
    sampling = {
        # SGLang's max_new_tokens=0 is its prefill-only scoring path, which skips sampling; the capture is taken
        # on the ordinary path with one token, which protocol_outputs drops again when 0 was asked for.
        "max_new_tokens": 1,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "stop_token_ids": list(params.stop_token_ids) or None,
        "skip_special_tokens": params.skip_special_tokens,
    }
    if params.sampling_seed is not None:
        sampling["sampling_seed"] = params.sampling_seed
    per_prompt = [
        {**sampling, "custom_params": CaptureTicket(name, plan.ticket_order).to_custom_params()}
        for name in plan.file_names
    ]

    def one_or_list(values: list[Any]) -> Any:
        return values if plan.is_batch else values[0]

    return {
        "input_ids": one_or_list(plan.prompts),
        "rid": one_or_list(plan.rids),
        "extra_key": one_or_list(plan.extra_keys),
        "sampling_params": one_or_list(per_prompt),
        # Makes the batch's result processor walk the hidden-state rows, where the plugin's hook takes them.
        "return_hidden_states": one_or_list([True] * len(plan.prompts)),
        "stream": False,
    }


def protocol_outputs(plan: CapturePlan, answer: Any) -> list[dict[str, Any]]:
    """SGLang's answer as the protocol's outputs, one per prompt; raises CaptureFailed for a missing capture."""
    outputs = answer if isinstance(answer, list) else [answer]
    if len(outputs) != len(plan.prompts):
        raise CaptureFailed(f"SGLang answered {len(outputs)} outputs for {len(plan.prompts)} prompts")
    asked_no_token = plan.request.sampling_params.max_new_tokens == 0
    translated = []
    for rid, prompt, file_name, output in zip(plan.rids, plan.prompts, plan.file_names, outputs, strict=True):
        sglang_meta = dict(output.get("meta_info") or {})
        results = sglang_meta.pop(CAPTURE_META_KEY, None)
        sglang_meta.pop("hidden_states", None)  # the stock per-request JSON list, left empty by the plugin
        result = results[-1] if isinstance(results, list) and results else None
        if not isinstance(result, dict):
            raise CaptureFailed(
                f"rid {rid}: SGLang answered without a capture result; is the plugin loaded in the scheduler "
                "(SGLANG_PLUGINS) and the server launched with --enable-return-aux-hidden-states?"
            )
        if "error" in result:
            raise CaptureFailed(f"rid {rid}: {result['error']}")
        if result.get("file") != file_name:
            raise CaptureFailed(f"rid {rid}: capture written to {result.get('file')!r}, expected {file_name!r}")
        # The scheduler compares rows with the prompt SGLang ran; this compares them with the prompt sent (SGLang
        # truncates a too-long prompt when launched with --allow-auto-truncate).
        ran = int(sglang_meta.get("prompt_tokens", len(prompt)))
        if ran != len(prompt) or int(result["rows"]) != len(prompt):
            raise CaptureFailed(
                f"rid {rid}: SGLang ran {ran} of the {len(prompt)} prompt tokens and captured {result['rows']} rows"
            )

        output_ids = list(output.get("output_ids") or [])
        finish_reason = sglang_meta.get("finish_reason")
        if asked_no_token:
            output_ids, finish_reason = [], {"type": "length", "length": 0}
        capture_meta: dict[str, Any] = {
            "aux_layer_ids": plan.aux_layer_ids,
            "rows": int(result["rows"]),
            "hidden_size": int(result["hidden_size"]),
            "dtype": "bfloat16",
        }
        if plan.transport == "shm":
            capture_meta["path"] = file_name
        meta_info = {
            **sglang_meta,
            "id": rid,
            "prompt_tokens": ran,
            "completion_tokens": len(output_ids),
            "finish_reason": finish_reason,
            "capture": capture_meta,
        }
        out: dict[str, Any] = {"output_ids": output_ids, "meta_info": meta_info}
        if "text" in output:
            out["text"] = "" if asked_no_token else output["text"]
        translated.append(out)
    return translated


def model_info_answer(
    stock: dict[str, Any], limits: ModelLimits, *, dtype: str, version: str, sglang_version: str
) -> dict[str, Any]:
    """SGLang's `/model_info` fields plus the protocol's (shared/capture/protocol.py: ModelInfo)."""
    return {
        **stock,
        "backend": "sglang",
        "version": version,
        "sglang_version": sglang_version,
        "num_hidden_layers": limits.num_hidden_layers,
        "hidden_size": limits.hidden_size,
        "vocab_size": limits.vocab_size,
        "default_aux_layer_ids": list(limits.capture_aux_layer_ids),
        "capture_aux_layer_ids": list(limits.capture_aux_layer_ids),
        "dtype": dtype,
        "max_context_length": limits.max_context_length,
    }

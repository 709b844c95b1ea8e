"""Scheduler side of the capture: from SGLang's flattened extend batch to one safetensors file per request.

What SGLang v0.5.23 hands the scheduler (read in `python/sglang/srt/layers/logits_processor.py` and
`python/sglang/srt/managers/scheduler_components/batch_result_processor.py`):
- With `--enable-return-aux-hidden-states` the server's hidden-state mode is FULL for every forward
  (`forward_batch_info.get_server_return_hidden_states_mode`), so `LogitsProcessorOutput.hidden_states` is the
  aux concatenation `[T, 3H]` (captures in ascending layer order, `pack_aux_hidden_states`) and
  `LogitsProcessorOutput.last_hidden_states` is the post-final-norm state `[T, H]` (`_get_last_hidden_states_to_
  store`), over the T rows of the whole flattened extend batch.
- Request i owns `extend_input_len_per_req[i]` consecutive rows (`_append_prefill_hidden_states` walks them with a
  running offset). That is the number of positions this forward computed: the prompt minus a prefix-cache hit,
  or only the last chunk of a chunked prefill. A capture needs every position, so fewer rows than the prompt is
  refused here rather than written short.

A request asks for a capture through `sampling_params.custom_params` (a JSON dict that SGLang carries from the
tokenizer manager to the scheduler's `Req` unchanged; SGLang itself uses it as a private transport, see
`REQUEST_REASONING_END_TOKEN_IDS_KEY` in `python/sglang/srt/sampling/sampling_params.py`). The result goes back
to the HTTP process as `Req.customized_info[CAPTURE_META_KEY]`, which SGLang copies into `meta_info`.
"""

import logging
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.capture.protocol import CAPTURE_DTYPE, CapturedStates, write_capture_file

logger = logging.getLogger(__name__)

# The meta_info / customized_info key that carries one capture result per request.
CAPTURE_META_KEY = "eagle3_capture"
# Keys inside sampling_params.custom_params.
_FILE_PARAM = "eagle3_capture_file"
_SLOTS_PARAM = "eagle3_capture_slots"


class PartialPrefill(ValueError):
    """The forward computed fewer positions than the prompt has, so a capture would be short."""


@dataclass(frozen=True)
class CaptureTicket:
    """What the scheduler needs to capture one request: the file to write and the order of the aux slots."""

    file_name: str  # relative to the plugin's shm_dir; chosen by the HTTP process
    # slot_order[k] = which of the server's capture layers (ascending) goes to output slot k: the protocol
    # concatenates the layers in the order the request named them.
    slot_order: tuple[int, ...]

    def to_custom_params(self) -> dict[str, Any]:
        return {_FILE_PARAM: self.file_name, _SLOTS_PARAM: list(self.slot_order)}

    @classmethod
    def from_custom_params(cls, custom_params: Mapping[str, Any] | None) -> "CaptureTicket | None":
        """The ticket of a capture request, None for every other request (they stay stock SGLang)."""
        if not isinstance(custom_params, Mapping) or _FILE_PARAM not in custom_params:
            return None
        file_name = custom_params[_FILE_PARAM]
        slots = custom_params.get(_SLOTS_PARAM)
        if not isinstance(file_name, str) or "/" in file_name or file_name in {"", ".", ".."}:
            raise ValueError(f"custom_params.{_FILE_PARAM}: {file_name!r} is not a file name")
        if not isinstance(slots, list) or not all(type(s) is int for s in slots):
            raise ValueError(f"custom_params.{_SLOTS_PARAM}: {slots!r} is not a list of slot indices")
        return cls(file_name, tuple(slots))


def slot_order(capture_layer_ids: Sequence[int], requested: Sequence[int]) -> tuple[int, ...]:
    """The slot order that turns the server's captures (ascending ids) into the requested order.

    Raises ValueError when the request names other layers than the server captures.
    """
    if sorted(requested) != sorted(capture_layer_ids) or len(set(requested)) != len(requested):
        raise ValueError(
            f"this server captures layers {sorted(capture_layer_ids)} (fixed at launch by "
            f"--return-aux-hidden-state-layer-ids); got {list(requested)}"
        )
    ascending = sorted(capture_layer_ids)
    return tuple(ascending.index(layer_id) for layer_id in requested)


def reorder_aux_slots(aux_hidden_state: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """[L, kH] with the k slices of width H put in `order`; the identity order returns the tensor itself."""
    k = len(order)
    if list(order) == list(range(k)):
        return aux_hidden_state
    rows, width = aux_hidden_state.shape
    assert width % k == 0, f"aux width {width} is not {k} slices"
    slices = aux_hidden_state.reshape(rows, k, width // k)  # (L, k, H)
    return slices[:, list(order)].reshape(rows, width)


def row_spans(extend_lens: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each request's rows in a flattened extend batch (the walk of _append_prefill_hidden_states)."""
    spans, offset = [], 0
    for length in extend_lens:
        spans.append((offset, offset + length))
        offset += length
    return spans


def check_full_prefill(rid: str, rows: int, prompt_len: int) -> None:
    """Raise PartialPrefill unless the forward computed every prompt position."""
    if rows == prompt_len:
        return
    if rows < prompt_len:
        raise PartialPrefill(
            f"rid {rid}: the forward computed {rows} of {prompt_len} prompt positions (a prefix-cache hit or a "
            "chunked prefill); send a fresh extra_key per request, or launch with --disable-radix-cache and "
            "--chunked-prefill-size -1"
        )
    raise PartialPrefill(f"rid {rid}: the forward computed {rows} positions for a prompt of {prompt_len} tokens")


# Next to a capture file that could not be written: the reason, for the HTTP process to answer with.
ERROR_FILE_SUFFIX = ".error"


def error_file_name(file_name: str) -> str:
    return file_name + ERROR_FILE_SUFFIX


class CaptureWriter:
    """Writes capture files into `shm_dir`, on `threads` background threads (0: on the calling thread).

    At Llama-8B size a 2,048-token prompt is 64 MB of capture, about 1.3 GB/s at SGLang's prefill rate. Written on
    the scheduler's thread, those bytes would hold back the next batch and every answer of this one; on the pool
    the scheduler goes on at once and the files of one batch are written in parallel. A file appears whole or not
    at all (`write_capture_file` renames it into place), and a write that fails leaves `error_file_name(name)`
    with the reason instead: the HTTP process waits for one of the two before it answers.
    """

    def __init__(self, shm_dir: Path, threads: int) -> None:
        self.shm_dir = shm_dir
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="eagle3-capture") if threads > 0 else None

    def write(self, ticket: CaptureTicket, rid: str, aux: torch.Tensor, final: torch.Tensor) -> None:
        """Write one request's rows (host tensors in SGLang's layer order); errors go to the error file."""
        if self._pool is None:
            self._write(ticket, rid, aux, final)
        else:
            self._pool.submit(self._write, ticket, rid, aux, final)

    def _write(self, ticket: CaptureTicket, rid: str, aux: torch.Tensor, final: torch.Tensor) -> None:
        try:
            states = CapturedStates(
                aux_hidden_state=reorder_aux_slots(aux, ticket.slot_order).to(CAPTURE_DTYPE),  # (L, 3H)
                hidden_state=final.to(CAPTURE_DTYPE),  # (L, H)
            )
            write_capture_file(self.shm_dir, ticket.file_name, states)
        except Exception as exc:
            logger.error("capture rid=%s: writing %s failed: %s", rid, ticket.file_name, exc)
            reason = f"rid {rid}: writing the capture failed: {exc}"
            # Whole or not at all, like the capture file: the HTTP process reads it as soon as it exists.
            error_path = self.shm_dir / error_file_name(ticket.file_name)
            partial = error_path.with_name(f".{error_path.name}.partial")
            partial.write_text(reason)
            os.replace(partial, error_path)


def capture_request(
    *,
    writer: CaptureWriter,
    ticket: CaptureTicket,
    rid: str,
    aux_hidden_states: torch.Tensor | None,
    last_hidden_states: torch.Tensor | None,
    start: int,
    end: int,
    prompt_len: int,
) -> dict[str, Any]:
    """Check one request's rows [start, end) of the batch tensors and hand them to the writer; the meta for
    `customized_info`.

    Returns {"file", "rows", "hidden_size"} or {"error"}: a failure is reported to the HTTP process (which
    answers 500 with it), never raised into SGLang's result loop, which would take the whole batch down.
    """
    try:
        if aux_hidden_states is None or last_hidden_states is None:
            raise ValueError(
                "SGLang returned no "
                + ("aux hidden states" if aux_hidden_states is None else "post-norm hidden states")
                + " for this batch; was the server launched with --enable-return-aux-hidden-states "
                "--speculative-algorithm EAGLE3?"
            )
        check_full_prefill(rid, end - start, prompt_len)
        hidden_size = last_hidden_states.shape[-1]
        k = len(ticket.slot_order)
        if aux_hidden_states.shape[-1] != k * hidden_size:
            raise ValueError(
                f"aux hidden states have width {aux_hidden_states.shape[-1]}, not {k} x hidden size {hidden_size}"
            )
        # Under the overlap scheduler both are already in pinned host memory (copied behind the forward); without
        # it they are still on the GPU, and are copied here, on the scheduler's thread and stream.
        writer.write(ticket, rid, aux_hidden_states[start:end].cpu(), last_hidden_states[start:end].cpu())
    except Exception as exc:
        logger.error("capture rid=%s failed: %s", rid, exc)
        return {"error": str(exc)}
    return {"file": ticket.file_name, "rows": end - start, "hidden_size": int(hidden_size)}


def without_empty_capture_meta(customized_info: dict[str, list[Any]], index: int) -> dict[str, list[Any]]:
    """`customized_info` of a batch output, less the capture key where request `index` has no capture.

    SGLang pads a customized_info key with an empty entry for every other request of the batch, which would put
    an empty `eagle3_capture` into the meta_info of plain requests batched with a capture request.
    """
    if CAPTURE_META_KEY in customized_info and not customized_info[CAPTURE_META_KEY][index]:
        return {key: values for key, values in customized_info.items() if key != CAPTURE_META_KEY}
    return customized_info


def is_writer_rank(*, pp_rank: int, attn_tp_rank: int, attn_cp_rank: int) -> bool:
    """Whether this scheduler writes captures: the one that talks to the tokenizer manager.

    The same rule as `Scheduler.init_ipc_channels` (`is_rank_zero`): every TP rank holds the same replicated
    hidden states, and only this rank's results reach the HTTP process. With DP attention each DP group has
    its own such rank, which writes the requests of its own group.
    """
    return pp_rank == 0 and attn_tp_rank == 0 and attn_cp_rank == 0

"""The capture protocol (docs/capture-protocol.md): request models, model info, and the tensor hand-off.

Hidden states never travel as JSON floats. They travel as safetensors bytes, either as the body of a
`/generate` response (transport "body") or as one file per prompt in a shared directory (transport "shm").

The safetensors reader and writer here are our own (about 60 lines, the format is a JSON header plus raw
bytes) rather than `safetensors.torch.save/load` because:
- the server's per-prompt tensors are views into one batch tensor, which `safetensors.torch.save` refuses
  ("tensors share memory") unless each is cloned first;
- the client decodes zero-copy: tensors are views over the received buffer, so a 100 MB body is not copied
  again on its way to storage.
The bytes are standard safetensors (tests read them with the `safetensors` library and vice versa).
"""

import json
import math
import mmap
import os
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from shared.errors import Eagle3Error, InferenceProtocolError
from shared.storage.sample_format import NUM_AUX_LAYERS

CAPTURE_CONTENT_TYPE = "application/vnd.eagle3.capture+safetensors"
CAPTURE_DTYPE = torch.bfloat16
CAPTURE_FILE_SUFFIX = ".safetensors"

# safetensors dtype names <-> torch dtypes; captured tensors are bf16, the rest keeps the reader general.
_DTYPE_BY_NAME: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAME_BY_DTYPE = {dtype: name for name, dtype in _DTYPE_BY_NAME.items()}
_HEADER_LENGTH_BYTES = 8  # little-endian u64 in front of the JSON header
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit


# ----------------------------------------------------------------------------------------------------------
# Request and model-info models


class CaptureSpec(BaseModel):
    """The `capture` extension of a `/generate` request."""

    model_config = ConfigDict(extra="forbid")

    # 0-indexed decoder layers whose residual-stream output is captured: Hugging Face output_hidden_states[i + 1].
    aux_layer_ids: list[StrictInt] = Field(min_length=NUM_AUX_LAYERS, max_length=NUM_AUX_LAYERS)
    transport: Literal["body", "shm"] = "body"


class SamplingParams(BaseModel):
    """The `sampling_params` of a `/generate` request (the SGLang fields this protocol supports)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: StrictInt = Field(default=128, ge=0)
    temperature: float = Field(default=1.0, ge=0.0)  # 0 is greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=-1, description="-1 keeps the whole vocabulary")
    # SGLang's name (its SamplingParams has no `seed`): the same request then works on both backends.
    sampling_seed: StrictInt | None = None
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
    skip_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_top_k(self) -> "SamplingParams":
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (whole vocabulary) or >= 1, got {self.top_k}")
        return self


class GenerateRequest(BaseModel):
    """A `/generate` request body (SGLang's GenerateReqInput shape, plus `capture`)."""

    model_config = ConfigDict(extra="forbid")

    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    text: str | list[str] | None = None
    rid: str | list[str] | None = None
    # SGLang keys its prefix cache on extra_key: a fresh one forces a full prefill, so every row is captured.
    # The reference backend has no prefix cache and accepts it only for compatibility.
    extra_key: str | list[str] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    capture: CaptureSpec | None = None

    @field_validator("input_ids", mode="before")
    @classmethod
    def _check_input_ids_shape(cls, value: Any) -> Any:
        # One clear message instead of pydantic's per-union-member errors ("list[int].0", "list[list[int]].0").
        def is_token_list(v: Any) -> bool:
            return isinstance(v, list) and all(type(t) is int for t in v)  # type(): bool is not a token id

        if value is None or is_token_list(value) or (isinstance(value, list) and all(map(is_token_list, value))):
            return value
        raise ValueError("must be a list of token ids (integers) or a list of such lists")

    @model_validator(mode="after")
    def _check_one_prompt_source(self) -> "GenerateRequest":
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("give exactly one of input_ids and text")
        return self


class ModelInfo(BaseModel):
    """`GET /get_model_info`: SGLang's fields plus what a capture client needs to plan and validate."""

    # Extra fields are ignored so that a newer server (or stock SGLang's additions) does not break clients.
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model_path: str
    tokenizer_path: str
    is_generation: bool = True
    backend: str
    version: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    default_aux_layer_ids: list[int]
    dtype: str  # the compute dtype of the model; captured tensors are always bf16
    # Set by backends that fix the capture layers at launch (SGLang): the only ids a request may ask for.
    capture_aux_layer_ids: list[int] | None = None
    sglang_version: str | None = None
    max_context_length: int


def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's default capture layers for an N-layer target: [1, N//2 - 1, N - 4] (SpecForge, SGLang)."""
    n = num_hidden_layers
    return [1, n // 2 - 1, n - 4]


# ----------------------------------------------------------------------------------------------------------
# Request checks: one copy for every backend, so a worker gets the same 400 for the same request from each


class InvalidRequest(Eagle3Error):
    """A request the server cannot serve (HTTP 400); the message names the field and the reason."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field, self.reason = field, reason

    @classmethod
    def from_validation_errors(cls, errors: Iterable[Mapping[str, Any]]) -> "InvalidRequest":
        """pydantic's errors of a request body as one message, "field.path: reason; ..." (FastAPI's "body"
        prefix dropped, a validator's message without pydantic's "Value error, ")."""
        messages = []
        for error in errors:
            location = ".".join(str(part) for part in error["loc"] if part != "body")
            reason = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]
            messages.append(f"{location}: {reason}" if location else reason)
        return cls("", "; ".join(messages))


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the served model and the server's context."""

    num_hidden_layers: int
    vocab_size: int  # token ids must lie in [0, vocab_size)
    max_context_length: int  # the longest prompt the server runs


def check_request(
    prompts: list[list[int]],
    is_batch: bool,
    params: SamplingParams,
    capture: CaptureSpec | None,
    limits: RequestLimits,
) -> None:
    """Raise InvalidRequest, naming the field, for a request this server cannot serve.

    The shape of the body (types, unknown fields, three layer ids) is GenerateRequest's; this checks the values
    against the model: prompts, token ids, lengths, layer ids, and that a capture decodes at most one token.
    """
    if not prompts:
        raise InvalidRequest("input_ids", "no prompts")
    for b, prompt in enumerate(prompts):
        name = f"input_ids[{b}]" if is_batch else "input_ids"
        if not prompt:
            raise InvalidRequest(name, "empty prompt")
        if min(prompt) < 0 or max(prompt) >= limits.vocab_size:
            position, token_id = next((i, t) for i, t in enumerate(prompt) if not 0 <= t < limits.vocab_size)
            raise InvalidRequest(
                f"{name}[{position}]", f"token id {token_id} is outside the vocabulary [0, {limits.vocab_size})"
            )
        if len(prompt) > limits.max_context_length:
            raise InvalidRequest(
                name, f"prompt of {len(prompt)} tokens exceeds max_context_length {limits.max_context_length}"
            )
        if params.max_new_tokens > 1 and len(prompt) + params.max_new_tokens > limits.max_context_length:
            raise InvalidRequest(
                "sampling_params.max_new_tokens",
                f"prompt of {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} exceeds "
                f"max_context_length {limits.max_context_length}",
            )
    if capture is None:
        return
    for layer_id in capture.aux_layer_ids:
        if not 0 <= layer_id < limits.num_hidden_layers:
            raise InvalidRequest(
                "capture.aux_layer_ids",
                f"layer id {layer_id} is outside [0, {limits.num_hidden_layers}) for this "
                f"{limits.num_hidden_layers}-layer model",
            )
    if params.max_new_tokens > 1:
        raise InvalidRequest(
            "sampling_params.max_new_tokens",
            f"a capture request runs the prompt once and generates at most 1 token, got {params.max_new_tokens}",
        )


def request_ids(rid: str | list[str] | None, n_prompts: int, is_batch: bool) -> list[str]:
    """One unique id per prompt: the request's, else generated."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n_prompts)]
    if is_batch != isinstance(rid, list):
        raise InvalidRequest("rid", "give one string for a single prompt and a list for a batch")
    rids = rid if isinstance(rid, list) else [rid]
    if len(rids) != n_prompts:
        raise InvalidRequest("rid", f"{len(rids)} ids for {n_prompts} prompts")
    if len(set(rids)) != len(rids):
        raise InvalidRequest("rid", "ids must be unique within a request")
    return rids


# ----------------------------------------------------------------------------------------------------------
# Captured tensors


@dataclass
class CapturedStates:
    """The capture of one prompt of L tokens, hidden size H."""

    aux_hidden_state: torch.Tensor  # bf16 [L, 3H], the aux layers concatenated in the order requested
    hidden_state: torch.Tensor  # bf16 [L, H], post-final-norm (the input to lm_head)
    meta_info: dict[str, Any] = field(default_factory=dict)


def encode_capture_body(states: list[CapturedStates]) -> bytearray:
    """A "body" transport response: tensors `aux_hidden_state.{i}`, `hidden_state.{i}`, metadata `meta_info`."""
    tensors: dict[str, torch.Tensor] = {}
    for i, state in enumerate(states):
        tensors[f"aux_hidden_state.{i}"] = state.aux_hidden_state
        tensors[f"hidden_state.{i}"] = state.hidden_state
    return _write_safetensors(tensors, {"meta_info": json.dumps([state.meta_info for state in states])})


def decode_capture_body(body: bytes | bytearray | memoryview) -> list[CapturedStates]:
    """The inverse of encode_capture_body; tensors view a writable `body` without a copy.

    Raises InferenceProtocolError for bytes that do not follow the protocol. Shapes, row counts and values are
    returned as received: checking them against the prompt is the caller's job.
    """
    tensors, metadata = _read_safetensors(body)
    if "meta_info" not in metadata:
        raise InferenceProtocolError("capture body: safetensors metadata has no meta_info")
    try:
        meta_infos = json.loads(metadata["meta_info"])
    except json.JSONDecodeError as exc:
        raise InferenceProtocolError(f"capture body: meta_info is not JSON: {exc}") from exc
    if not isinstance(meta_infos, list) or not all(isinstance(m, dict) for m in meta_infos):
        raise InferenceProtocolError("capture body: meta_info must be a JSON list of objects, one per prompt")
    expected = {f"{name}.{i}" for i in range(len(meta_infos)) for name in ("aux_hidden_state", "hidden_state")}
    if set(tensors) != expected:
        raise InferenceProtocolError(
            f"capture body: {len(meta_infos)} meta_info entries need tensors {sorted(expected)}, got {sorted(tensors)}"
        )
    return [
        CapturedStates(tensors[f"aux_hidden_state.{i}"], tensors[f"hidden_state.{i}"], meta_info)
        for i, meta_info in enumerate(meta_infos)
    ]


def capture_file_name(rid: str) -> str:
    """The shm file name of a request id: one flat name, safe for any rid (no '/' and so no path traversal)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in rid)
    return safe + CAPTURE_FILE_SUFFIX


def write_capture_file(directory: Path, name: str, states: CapturedStates) -> Path:
    """Write one prompt's tensors as `directory/name`, atomically: a reader never sees a partial file.

    The tensor bytes go straight from the tensors to the file (one copy, in the kernel, without the GIL), not
    through an intermediate buffer: the server writes about 128 MB per 2048-token prompt at Llama-8B size."""
    tensors = {"aux_hidden_state": states.aux_hidden_state, "hidden_state": states.hidden_state}
    header = _safetensors_header(tensors, metadata={})
    path = directory / name
    # Same directory as the target, so the rename stays on one filesystem and is atomic.
    tmp_path = directory / f".{name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp_path, "wb", buffering=0) as f:
            f.write(header)
            for tensor in tensors.values():
                if tensor.numel():
                    # ndarray.data is memoryview(ndarray): numpy declares the buffer protocol only for Python 3.12+.
                    f.write(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().data)
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return path


def read_capture_file(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux_hidden_state, hidden_state) of a file written by write_capture_file; raises InferenceProtocolError.

    The tensors view a private, copy-on-write mapping of the file rather than a copy of it: no bytes are copied
    to read 64 MB, and deleting the file afterwards (the reader owns it) leaves the tensors valid."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise InferenceProtocolError(f"capture file {path}: empty")
        data = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        tensors, _ = _read_safetensors(data)
    except InferenceProtocolError as exc:
        raise InferenceProtocolError(f"capture file {path}: {exc}") from exc
    if set(tensors) != {"aux_hidden_state", "hidden_state"}:
        raise InferenceProtocolError(
            f"capture file {path}: needs tensors aux_hidden_state and hidden_state, got {sorted(tensors)}"
        )
    return tensors["aux_hidden_state"], tensors["hidden_state"]


# ----------------------------------------------------------------------------------------------------------
# safetensors: 8-byte header length, JSON header {name: {dtype, shape, data_offsets}, __metadata__}, raw bytes


def _safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header; the tensors' bytes follow in the order given, without gaps."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _NAME_BY_DTYPE:
            raise ValueError(f"{name}: dtype {tensor.dtype} has no safetensors name")
        n_bytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _NAME_BY_DTYPE[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + n_bytes],
        }
        offset += n_bytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    # The data section starts 8-byte aligned (the format pads the header with spaces).
    header_bytes += b" " * (-len(header_bytes) % 8)
    return len(header_bytes).to_bytes(_HEADER_LENGTH_BYTES, "little") + header_bytes


def _write_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytearray:
    header = _safetensors_header(tensors, metadata)
    out = bytearray(len(header) + sum(t.numel() * t.element_size() for t in tensors.values()))
    out[: len(header)] = header
    offset = len(header)
    for tensor in tensors.values():
        if tensor.numel():
            # Copy straight into the output buffer: one copy per tensor, from any device and any strides.
            target = torch.frombuffer(out, dtype=tensor.dtype, count=tensor.numel(), offset=offset)
            target.view(tensor.shape).copy_(tensor)
        offset += tensor.numel() * tensor.element_size()
    return out


def _read_safetensors(
    data: bytes | bytearray | memoryview | mmap.mmap,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata; every offset is checked before it is used.

    The tensors are views over `data` when it is writable (a bytearray), else over a private copy: a tensor
    over immutable bytes would let an in-place op rewrite a `bytes` object.
    """
    buffer = memoryview(data).cast("B")
    if buffer.readonly:
        buffer = memoryview(bytearray(buffer))
    if len(buffer) < _HEADER_LENGTH_BYTES:
        raise InferenceProtocolError(f"not safetensors: {len(buffer)} bytes is shorter than the header length")
    header_len = int.from_bytes(buffer[:_HEADER_LENGTH_BYTES], "little")
    data_start = _HEADER_LENGTH_BYTES + header_len
    if header_len > _MAX_HEADER_BYTES or data_start > len(buffer):
        raise InferenceProtocolError(f"not safetensors: header length {header_len} for {len(buffer)} bytes")
    try:
        header = json.loads(bytes(buffer[_HEADER_LENGTH_BYTES:data_start]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InferenceProtocolError(f"not safetensors: header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise InferenceProtocolError("not safetensors: header is not a JSON object")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InferenceProtocolError("safetensors __metadata__ must map names to strings")
    data_len = len(buffer) - data_start
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        try:
            dtype = _DTYPE_BY_NAME[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InferenceProtocolError(f"safetensors tensor {name}: malformed header entry {entry!r}") from exc
        numel = math.prod(shape)
        n_bytes = numel * dtype.itemsize
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_len or end - begin != n_bytes:
            raise InferenceProtocolError(
                f"safetensors tensor {name}: shape {shape} {entry['dtype']} at offsets [{begin}, {end}) "
                f"does not fit {data_len} data bytes"
            )
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)  # frombuffer refuses a zero count
        else:
            tensors[name] = torch.frombuffer(buffer, dtype=dtype, count=numel, offset=data_start + begin).view(shape)
    return tensors, metadata

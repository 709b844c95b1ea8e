"""The reference inference engine: any local Hugging Face causal LM behind one batching thread.

- Capture by forward hooks on the decoder layers: the output of `base_model.layers[i]` is the residual stream
  after layer i, Hugging Face `output_hidden_states[i + 1]`. The final state is the base model's
  `last_hidden_state` (post-final-norm, the input to `lm_head`). One caveat for i = N - 1: transformers 5
  puts the post-norm state at `output_hidden_states[N]`, while the hook keeps the raw residual of that layer.
- No full-vocabulary logits for the prompt: `lm_head` runs on the last position of each prompt only.
- One thread owns the model and runs every forward pass, so hooks and the global RNG need no locks.
  Concurrent prefill requests (capture, or at most one generated token) are gathered for at most
  `max_batch_wait_ms`, sorted by length, right-padded into forwards of at most `max_batch_tokens` padded
  tokens, and split back to true lengths.
- Decoding (`max_new_tokens > 1`) runs `model.generate`. Concurrent decode requests with the same sampling
  (temperature, top-p, top-k, stop tokens; a seeded sampling request always runs alone, so that its seed alone
  decides its tokens) are gathered for at most `decode_batch_wait_ms`, up to `max_decode_batch` prompts, and
  their prompts left-padded into one `generate` call of the largest `max_new_tokens`; each row is then cut to
  its own request's `max_new_tokens` and first stop token. Greedy output is Hugging Face's greedy output token
  for token, batched or not (tests/integration/test_reference_server.py).
"""

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

import shared
from shared.capture.protocol import (
    CAPTURE_DTYPE,
    CapturedStates,
    CaptureSpec,
    ModelInfo,
    RequestLimits,
    SamplingParams,
    check_request,
    default_aux_layer_ids,
)
from shared.errors import ConfigurationError, Eagle3Error
from shared.settings import Settings

logger = logging.getLogger(__name__)

_BATCH_PROMPT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_BATCH_TOKEN_BUCKETS = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class EngineUnavailable(Eagle3Error):
    """The engine is loading, failed to load, or is shutting down (HTTP 503)."""


class InferenceMetrics:
    """The Prometheus metrics of one engine, in their own registry so that several engines can share a process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "eagle3_inference_requests", "Completed /generate requests", ["kind"], registry=self.registry
        )
        self.prompt_tokens = Counter("eagle3_inference_prompt_tokens", "Prompt tokens served", registry=self.registry)
        self.generated_tokens = Counter("eagle3_inference_generated_tokens", "Tokens generated", registry=self.registry)
        self.errors = Counter(
            "eagle3_inference_errors", "Failed /generate requests", ["reason"], registry=self.registry
        )
        self.batch_prompts = Histogram(
            "eagle3_inference_batch_prompts",
            "Prompts per prefill forward pass",
            buckets=_BATCH_PROMPT_BUCKETS,
            registry=self.registry,
        )
        self.batch_tokens = Histogram(
            "eagle3_inference_batch_tokens",
            "Padded tokens per prefill forward pass",
            buckets=_BATCH_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.decode_batch_prompts = Histogram(
            "eagle3_inference_decode_batch_prompts",
            "Prompts per decoding generate call",
            buckets=_BATCH_PROMPT_BUCKETS,
            registry=self.registry,
        )


@dataclass
class PromptResult:
    """What the engine produced for one prompt; the server turns it into the protocol's response."""

    output_ids: list[int]
    finish_reason: dict[str, Any]
    captured: CapturedStates | None  # meta_info left empty: the server owns the response fields


@dataclass
class _Request:
    """One /generate request in the engine's queue; its prompts may be spread over several forwards."""

    prompts: list[list[int]]
    params: SamplingParams
    capture: CaptureSpec | None
    future: Future[list[PromptResult]] = field(default_factory=Future)
    results: dict[int, PromptResult] = field(default_factory=dict)
    failed: bool = False

    @property
    def is_decode(self) -> bool:
        return self.params.max_new_tokens > 1

    @property
    def num_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def decode_key(self) -> tuple[Any, ...]:
        """Decode requests with equal keys can share one generate call (max_new_tokens may differ)."""
        p = self.params
        stop = tuple(sorted(set(p.stop_token_ids)))
        if p.temperature == 0:
            return ("greedy", stop)
        if p.sampling_seed is not None:
            return ("seeded", id(self))  # its seed alone decides its tokens: never batched
        return ("sample", p.temperature, p.top_p, p.top_k, stop)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Device-to-host copy of captured states in bf16. From CUDA it goes through pinned memory, several times
    faster than a copy into pageable memory; PyTorch's caching host allocator reuses the pinned blocks once the
    responses that view them are written, so steady state allocates nothing. The caller synchronizes."""
    if tensor.device.type != "cuda":
        return tensor.to("cpu", CAPTURE_DTYPE)
    host = torch.empty(tensor.shape, dtype=CAPTURE_DTYPE, pin_memory=True)
    host.copy_(tensor.to(CAPTURE_DTYPE), non_blocking=True)
    return host


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto": bf16 where the hardware computes it natively (CUDA; CPUs with AVX-512 BF16 or AMX), else fp32.
    On a CPU without native bf16, bf16 matmuls are emulated and several times slower than fp32 (measured 4x
    on an AVX2-only EPYC); captured tensors are bf16 either way."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if _cpu_has_native_bf16() else torch.float32


def _cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class ReferenceEngine:
    """A Hugging Face causal LM that serves capture and decoding requests from one background thread."""

    def __init__(
        self,
        model_path: Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_batch_tokens: int = 8192,
        max_batch_wait_ms: float = 5.0,
        max_decode_batch: int = 64,
        decode_batch_wait_ms: float = 50.0,
    ) -> None:
        self.model_path = Path(model_path)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.dtype: torch.dtype = compute_dtype(dtype, self.device)
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_wait_s = max_batch_wait_ms / 1000
        self.max_decode_batch = max_decode_batch
        self.decode_batch_wait_s = decode_batch_wait_ms / 1000
        self.metrics = InferenceMetrics()
        self.load_error: BaseException | None = None

        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self._closing = False
        self._start_lock = threading.Lock()
        # Set by the engine thread around a prefill forward; read by the layer hooks on the same thread.
        self._capture_layer_ids: frozenset[int] = frozenset()
        self._captured: dict[int, torch.Tensor] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> "ReferenceEngine":
        if settings.model_path is None:
            raise ConfigurationError("EAGLE3_MODEL_PATH is not set: the reference server needs a local model folder")
        return cls(
            settings.model_path,
            device=settings.inference_device,
            dtype=settings.inference_dtype,
            max_batch_tokens=settings.inference_max_batch_tokens,
            max_batch_wait_ms=settings.inference_max_batch_wait_ms,
            max_decode_batch=settings.inference_max_decode_batch,
            decode_batch_wait_ms=settings.inference_decode_batch_wait_ms,
        )

    # ------------------------------------------------------------------------------------------------------
    # Lifecycle

    def start(self) -> None:
        """Start loading in the engine thread and return at once; `ready` turns true when a forward pass worked."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="reference-engine", daemon=True)
                self._thread.start()

    def wait_loaded(self, timeout_s: float | None = None) -> bool:
        """Block until loading finished, successfully or not (see `load_error`); False on timeout."""
        return self._loaded.wait(timeout_s)

    @property
    def ready(self) -> bool:
        return (
            self._loaded.is_set()
            and self.load_error is None
            and not self._closing
            and self._thread is not None
            and self._thread.is_alive()
        )

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the forward in progress, fail whatever is still queued, and stop the thread."""
        self._closing = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._fail_queued()

    # ------------------------------------------------------------------------------------------------------
    # Requests

    @property
    def model_info(self) -> ModelInfo:
        self._require_ready()
        return self._model_info

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        self._require_ready()
        return self._tokenizer

    def check(
        self, prompts: list[list[int]], is_batch: bool, params: SamplingParams, capture: CaptureSpec | None
    ) -> None:
        """Raise InvalidRequest, naming the field, for a request this model cannot serve."""
        limits = RequestLimits(
            num_hidden_layers=self.model_info.num_hidden_layers,
            vocab_size=self._vocab_rows,  # the embedding's rows: a padded vocabulary takes every id it has a row for
            max_context_length=self.model_info.max_context_length,
        )
        check_request(prompts, is_batch, params, capture, limits)

    def submit(
        self, prompts: list[list[int]], params: SamplingParams, capture: CaptureSpec | None
    ) -> Future[list[PromptResult]]:
        """Queue a checked request; the future resolves to one PromptResult per prompt, in order."""
        self._require_ready()
        request = _Request(prompts, params, capture)
        self._queue.put(request)
        return request.future

    def _require_ready(self) -> None:
        if self.load_error is not None:
            raise EngineUnavailable(f"model {self.model_path} failed to load: {self.load_error}")
        if self._closing:
            raise EngineUnavailable("the engine is shutting down")
        if not self._loaded.is_set():
            raise EngineUnavailable(f"model {self.model_path} is loading")

    # ------------------------------------------------------------------------------------------------------
    # The engine thread

    def _run(self) -> None:
        torch.set_grad_enabled(False)  # grad mode is per thread, and this thread runs every forward
        try:
            self._load()
        except BaseException as exc:
            logger.exception("failed to load model %s", self.model_path)
            self.load_error = exc
            self._loaded.set()
            return
        self._loaded.set()

        backlog: deque[_Request | None] = deque()  # taken off the queue while gathering, not yet run
        while True:
            request = backlog.popleft() if backlog else self._queue.get()
            if request is None:
                return
            if not request.future.set_running_or_notify_cancel():
                continue  # the client went away before its turn
            if request.is_decode:
                self._serve_decode(self._gather_decode(request, backlog))
                continue
            group = [request]
            tokens = request.num_tokens
            deadline = time.monotonic() + self.max_batch_wait_s
            while tokens < self.max_batch_tokens:
                remaining_s = deadline - time.monotonic()
                try:
                    following = self._queue.get(timeout=remaining_s) if remaining_s > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if following is None or following.is_decode:
                    backlog.append(following)
                    break
                if following.future.set_running_or_notify_cancel():
                    group.append(following)
                    tokens += following.num_tokens
            self._serve_prefill(group)

    def _gather_decode(self, first: _Request, backlog: deque[_Request | None]) -> list[_Request]:
        """`first` and the decode requests that arrive within the wait and can share its generate call. The first
        request that cannot (another kind, other sampling, too many prompts, too long) goes to the backlog."""
        group = [first]
        num_prompts = len(first.prompts)
        longest = max(len(p) for p in first.prompts)
        most_new = first.params.max_new_tokens
        context = self._model_info.max_context_length
        deadline = time.monotonic() + self.decode_batch_wait_s
        while num_prompts < self.max_decode_batch:
            remaining_s = deadline - time.monotonic()
            try:
                following = self._queue.get(timeout=remaining_s) if remaining_s > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            fits = (
                following is not None
                and following.is_decode
                and following.decode_key == first.decode_key
                and num_prompts + len(following.prompts) <= self.max_decode_batch
                # Left padding makes every row as long as the longest prompt plus the most new tokens.
                and max(longest, *map(len, following.prompts)) + max(most_new, following.params.max_new_tokens)
                <= context
            )
            if not fits:
                backlog.append(following)
                break
            assert following is not None
            if following.future.set_running_or_notify_cancel():
                group.append(following)
                num_prompts += len(following.prompts)
                longest = max(longest, *map(len, following.prompts))
                most_new = max(most_new, following.params.max_new_tokens)
        return group

    def _fail_queued(self) -> None:
        while True:
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                return
            if request is not None and request.future.set_running_or_notify_cancel():
                request.future.set_exception(EngineUnavailable("the engine shut down before this request ran"))

    def _load(self) -> None:
        start = time.monotonic()
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, local_files_only=True, dtype=self.dtype)
        # transformers wraps PreTrainedModel.to in functools.wraps(Module.to), whose type leaves `self` unbound.
        model.to(self.device).eval().requires_grad_(False)  # type: ignore[arg-type]
        layers = getattr(model.base_model, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            raise ConfigurationError(
                f"{self.model_path}: {type(model).__name__} has no base_model.layers, where the reference backend "
                "hooks the decoder layers"
            )
        for layer_id, layer in enumerate(layers):
            layer.register_forward_hook(partial(self._capture_hook, layer_id))
        self._model = model
        self._lm_head = model.get_output_embeddings()
        # transformers types the input embeddings as any nn.Module; a causal LM's are an nn.Embedding.
        self._vocab_rows = cast(torch.nn.Embedding, model.get_input_embeddings()).num_embeddings

        text_config = model.config.get_text_config()
        num_layers = len(layers)
        self._eos_token_ids = _eos_token_ids(model, self._tokenizer)
        pad = self._tokenizer.pad_token_id
        self._pad_token_id = pad if pad is not None else (min(self._eos_token_ids) if self._eos_token_ids else 0)
        self._model_info = ModelInfo(
            model_path=str(self.model_path),
            tokenizer_path=str(self.model_path),
            is_generation=True,
            backend="reference",
            version=shared.__version__,
            num_hidden_layers=num_layers,
            hidden_size=text_config.hidden_size,
            vocab_size=text_config.vocab_size,
            default_aux_layer_ids=default_aux_layer_ids(num_layers),
            dtype=str(self.dtype).removeprefix("torch."),
            max_context_length=_max_context_length(text_config, self._tokenizer),
        )
        # /health promises that a forward pass works, so run one (it also warms up the kernels).
        warmup = CaptureSpec(aux_layer_ids=[0, num_layers // 2, num_layers - 1])
        self._prefill([[self._pad_token_id] * 4], [SamplingParams(max_new_tokens=1, temperature=0)], [warmup])
        logger.info(
            "loaded model=%s layers=%d hidden=%d device=%s dtype=%s in %.1fs",
            self.model_path,
            num_layers,
            text_config.hidden_size,
            self.device,
            self._model_info.dtype,
            time.monotonic() - start,
        )

    def _capture_hook(self, layer_id: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        if layer_id in self._capture_layer_ids:
            # Some architectures return a tuple whose first element is the hidden state.
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

    # ------------------------------------------------------------------------------------------------------
    # Prefill: capture and at most one generated token, batched across requests

    def _serve_prefill(self, group: list[_Request]) -> None:
        # Sort the group's prompts longest first, so each forward pads to the length of its first prompt.
        items = sorted(
            ((request, b) for request in group for b in range(len(request.prompts))),
            key=lambda item: len(item[0].prompts[item[1]]),
            reverse=True,
        )
        batch: list[tuple[_Request, int]] = []
        for item in items:
            longest = len(batch[0][0].prompts[batch[0][1]]) if batch else 0
            if batch and (len(batch) + 1) * longest > self.max_batch_tokens:
                self._forward(batch)
                batch = []
            batch.append(item)
        self._forward(batch)

    def _forward(self, batch: list[tuple[_Request, int]]) -> None:
        live = [(request, b) for request, b in batch if not request.failed]
        if not live:
            return
        try:
            results = self._prefill(
                [request.prompts[b] for request, b in live],
                [request.params for request, _ in live],
                [request.capture for request, _ in live],
            )
        except Exception as exc:
            logger.exception("prefill forward of %d prompts failed", len(live))
            for request, _ in live:
                if not request.failed:
                    request.failed = True
                    request.future.set_exception(exc)
            return
        for (request, b), result in zip(live, results, strict=True):
            request.results[b] = result
            if len(request.results) == len(request.prompts):
                request.future.set_result([request.results[i] for i in range(len(request.prompts))])

    def _prefill(
        self, prompts: list[list[int]], params: list[SamplingParams], captures: list[CaptureSpec | None]
    ) -> list[PromptResult]:
        # B prompts, T = the longest prompt, H = hidden size, V = vocabulary size
        lengths = [len(p) for p in prompts]
        B, T = len(prompts), max(lengths)
        input_ids = torch.full((B, T), self._pad_token_id, dtype=torch.long)
        for b, prompt in enumerate(prompts):
            input_ids[b, : len(prompt)] = torch.tensor(prompt)
        # Right padding keeps every true token at its own position; the mask hides the pads from attention.
        # Without pads there is no mask, which lets attention take its causal fast path.
        padded = min(lengths) < T
        attention_mask = (torch.arange(T) < torch.tensor(lengths)[:, None]).long() if padded else None  # (B, T)

        self._capture_layer_ids = frozenset(i for c in captures if c is not None for i in c.aux_layer_ids)
        try:
            output = self._model.base_model(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device) if attention_mask is not None else None,
                use_cache=False,
            )
        finally:
            captured, self._captured, self._capture_layer_ids = self._captured, {}, frozenset()
        final = output.last_hidden_state  # (B, T, H), post-final-norm
        self.metrics.batch_prompts.observe(B)
        self.metrics.batch_tokens.observe(B * T)

        # Logits only at each prompt's last position, and only for prompts that generate a token.
        generating = [b for b in range(B) if params[b].max_new_tokens >= 1]
        next_ids: dict[int, int] = {}
        if generating:
            rows = torch.tensor(generating, device=final.device)
            last_positions = torch.tensor([lengths[b] - 1 for b in generating], device=final.device)
            logits = self._lm_head(final[rows, last_positions]).float()  # (B_generating, V)
            for row, b in enumerate(generating):
                next_ids[b] = _next_token(logits[row], params[b])

        # One device-to-host copy per distinct layer-id list (usually one), then per-prompt views.
        final_cpu = _to_host(final) if any(c is not None for c in captures) else None
        aux_cpu: dict[tuple[int, ...], torch.Tensor] = {}
        for capture in captures:
            if capture is not None and tuple(capture.aux_layer_ids) not in aux_cpu:
                ids = tuple(capture.aux_layer_ids)
                aux_cpu[ids] = _to_host(torch.cat([captured[i] for i in ids], dim=-1))  # (B, T, 3H)

        if final.device.type == "cuda":
            torch.cuda.current_stream(final.device).synchronize()  # the non-blocking copies have landed
        results = []
        for b, (length, capture) in enumerate(zip(lengths, captures, strict=True)):
            states = None
            if capture is not None:
                assert final_cpu is not None
                aux = aux_cpu[tuple(capture.aux_layer_ids)]
                states = CapturedStates(aux_hidden_state=aux[b, :length], hidden_state=final_cpu[b, :length])
            output_ids = [next_ids[b]] if b in next_ids else []
            results.append(PromptResult(output_ids, self._finish_reason(output_ids, params[b]), states))
        return results

    # ------------------------------------------------------------------------------------------------------
    # Decoding: model.generate over the prompts of compatible concurrent requests

    def _serve_decode(self, group: list[_Request]) -> None:
        prompts = [prompt for request in group for prompt in request.prompts]
        # One generate call runs to the largest max_new_tokens; each row is cut to its own request's below.
        params = group[0].params.model_copy(update={"max_new_tokens": max(r.params.max_new_tokens for r in group)})
        try:
            rows = self._decode(prompts, params)
        except Exception as exc:
            logger.exception("decoding %d prompts of %d requests failed", len(prompts), len(group))
            for request in group:
                request.future.set_exception(exc)
            return
        self.metrics.decode_batch_prompts.observe(len(prompts))
        start = 0
        for request in group:
            results = []
            for output_ids in rows[start : start + len(request.prompts)]:
                output_ids = output_ids[: request.params.max_new_tokens]
                results.append(PromptResult(output_ids, self._finish_reason(output_ids, request.params), None))
            start += len(request.prompts)
            request.future.set_result(results)

    def _decode(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Each prompt's generated ids, up to and including its first stop token."""
        # B prompts, T = the longest prompt, N = max_new_tokens
        B, T = len(prompts), max(len(p) for p in prompts)
        # Left padding: every row's last prompt token sits in column T - 1, where generation continues.
        input_ids = torch.full((B, T), self._pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((B, T), dtype=torch.long)
        for b, prompt in enumerate(prompts):
            input_ids[b, T - len(prompt) :] = torch.tensor(prompt)
            attention_mask[b, T - len(prompt) :] = 1
        stop_ids = self._stop_token_ids(params)
        sampling: dict[str, Any] = {"do_sample": False}
        if params.temperature > 0:
            top_k = params.top_k if params.top_k > 0 else 0  # transformers: 0 disables top-k
            sampling = {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": top_k}
            if params.sampling_seed is not None:
                torch.manual_seed(params.sampling_seed)  # the global RNG is safe to reseed: only this thread samples
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            eos_token_id=sorted(stop_ids) or None,
            pad_token_id=self._pad_token_id,
            repetition_penalty=1.0,  # explicit: a model's own generation_config must not add penalties
            **sampling,
        )
        sequences = self._model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            generation_config=config,
        )  # (B, T + n), n <= N
        rows = []
        for row in sequences[:, T:].tolist():
            # After a row stops, generate pads it: keep tokens up to and including the first stop token.
            stop_at = next((i for i, token in enumerate(row) if token in stop_ids), None)
            rows.append(row if stop_at is None else row[: stop_at + 1])
        return rows

    def _stop_token_ids(self, params: SamplingParams) -> set[int]:
        return self._eos_token_ids | set(params.stop_token_ids)

    def _finish_reason(self, output_ids: list[int], params: SamplingParams) -> dict[str, Any]:
        if output_ids and output_ids[-1] in self._stop_token_ids(params):
            return {"type": "stop", "matched": output_ids[-1]}
        return {"type": "length", "length": len(output_ids)}


def _next_token(logits: torch.Tensor, params: SamplingParams) -> int:
    """One token from fp32 logits (V,): argmax at temperature 0, else temperature, top-k, top-p sampling."""
    if params.temperature == 0:
        return int(logits.argmax())
    logits = logits / params.temperature
    if params.top_k > 0:
        kth_largest = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens ranked above it already cover top_p; the most likely token always stays.
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    generator = None
    if params.sampling_seed is not None:
        generator = torch.Generator(device=logits.device).manual_seed(params.sampling_seed)
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every end-of-sequence id the model folder declares (generation config, model config, tokenizer)."""
    ids: set[int] = set()
    for value in (
        model.generation_config.eos_token_id,
        model.config.get_text_config().eos_token_id,
        tokenizer.eos_token_id,
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(value)
    return ids


def _max_context_length(text_config: Any, tokenizer: PreTrainedTokenizerBase) -> int:
    max_positions = getattr(text_config, "max_position_embeddings", None)
    if isinstance(max_positions, int):
        return max_positions
    # Tokenizers without a limit report a huge sentinel (int(1e30)); only a real limit is usable.
    if tokenizer.model_max_length < 10**7:
        return int(tokenizer.model_max_length)
    raise ConfigurationError("the model config has no max_position_embeddings and the tokenizer no model_max_length")

"""An inference stand-in for bench/fleet.py: the capture protocol (docs/capture-protocol.md) without a model.

It answers the endpoints a worker calls (`GET /health`, `GET /get_model_info`, `POST /generate` with `capture` over
the body transport) with correctly shaped bf16 states of random values, at once: the fleet benchmark measures the
control plane (producer, Redis, leases, commits), so inference must cost as little as possible while the worker's own
code path (client, decode, validation, sample files, manifest) runs unchanged. The request is parsed and checked with
the protocol's own models, so a worker gets the same answers and errors as from a real server.

A bare ASGI app under uvicorn rather than FastAPI: with hundreds of simulated workers on two cores every
millisecond per request is taken from the processes being measured.

    python -m bench.capture_standin --model-path DIR    # DIR/config.json gives the shape

The port and model folder default to EAGLE3_INFERENCE_PORT and EAGLE3_MODEL_PATH, as the local stack exports them.
"""

import argparse
import json
from pathlib import Path

import torch
import uvicorn
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from shared.capture.protocol import (
    CAPTURE_CONTENT_TYPE,
    CapturedStates,
    GenerateRequest,
    InvalidRequest,
    ModelInfo,
    RequestLimits,
    check_request,
    default_aux_layer_ids,
    encode_capture_body,
    request_ids,
)
from shared.settings import Settings


class CaptureStandIn:
    """The ASGI app. Random states are drawn once, `max_context_length` rows, and sliced per prompt: the values do not
    matter (the worker checks shapes, dtype, finiteness and that they are not all zero), their cost would."""

    def __init__(self, model_path: Path, max_context_length: int) -> None:
        config = json.loads((model_path / "config.json").read_text())
        self.hidden_size = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        self.info = ModelInfo(
            model_path=str(model_path),
            tokenizer_path=str(model_path),
            backend="bench-standin",
            version="0.1.0",
            num_hidden_layers=layers,
            hidden_size=self.hidden_size,
            vocab_size=int(config["vocab_size"]),
            default_aux_layer_ids=default_aux_layer_ids(layers),
            dtype="bfloat16",
            max_context_length=max_context_length,
        )
        self.limits = RequestLimits(layers, self.info.vocab_size, max_context_length)
        generator = torch.Generator().manual_seed(0)
        self.aux = torch.randn(max_context_length, 3 * self.hidden_size, generator=generator).to(torch.bfloat16)
        self.final = torch.randn(max_context_length, self.hidden_size, generator=generator).to(torch.bfloat16)
        self.info_body = self.info.model_dump_json().encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        if method == "GET" and path == "/health":
            await _respond(send, 200, b"", "text/plain")
        elif method == "GET" and path == "/get_model_info":
            await _respond(send, 200, self.info_body, "application/json")
        elif method == "POST" and path == "/generate":
            body = await _body(receive)
            try:
                content = self.generate(body)
            except (InvalidRequest, ValidationError, ValueError) as exc:
                await _respond(send, 400, json.dumps({"error": {"message": str(exc)}}).encode(), "application/json")
            else:
                await _respond(send, 200, bytes(content), CAPTURE_CONTENT_TYPE)
        else:
            await _respond(send, 404, b'{"error": {"message": "not found"}}', "application/json")

    def generate(self, body: bytes) -> bytearray:
        request = GenerateRequest.model_validate_json(body)
        if request.input_ids is None or request.capture is None or request.capture.transport != "body":
            raise InvalidRequest("capture", "this stand-in serves captures over the body transport only")
        is_batch = bool(request.input_ids) and isinstance(request.input_ids[0], list)
        prompts: list[list[int]] = request.input_ids if is_batch else [request.input_ids]  # type: ignore[assignment,list-item]
        check_request(prompts, is_batch, request.sampling_params, request.capture, self.limits)
        rids = request_ids(request.rid, len(prompts), is_batch)
        ids = request.capture.aux_layer_ids
        states = [
            CapturedStates(
                self.aux[: len(prompt)],
                self.final[: len(prompt)],
                {
                    "id": rid,
                    "prompt_tokens": len(prompt),
                    "completion_tokens": 1,
                    "finish_reason": {"type": "length", "length": 1},
                    "capture": {"aux_layer_ids": ids, "rows": len(prompt), "hidden_size": self.hidden_size},
                },
            )
            for prompt, rid in zip(prompts, rids, strict=True)
        ]
        return encode_capture_body(states)


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _respond(send: Send, status: int, body: bytes, content_type: str) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    settings = Settings()
    parser.add_argument(
        "--model-path", type=Path, default=settings.model_path, help="a folder whose config.json gives the shape"
    )
    parser.add_argument("--host", default=settings.inference_host)
    parser.add_argument("--port", type=int, default=settings.inference_port)
    parser.add_argument("--max-context-length", type=int, default=8192)
    args = parser.parse_args()
    if args.model_path is None:
        parser.error("--model-path (or EAGLE3_MODEL_PATH) is required")
    app = CaptureStandIn(args.model_path, args.max_context_length)
    # Many keep-alive connections (4 per simulated worker process) and no access log: the log would cost more CPU
    # than the answers.
    uvicorn.run(
        app, host=args.host, port=args.port, log_level="warning", access_log=False, lifespan="off", backlog=4096
    )


if __name__ == "__main__":
    main()

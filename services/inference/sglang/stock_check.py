"""Stock-launch check for a GPU host: plain `sglang.launch_server` where the capture plugin is installed.

    python services/inference/sglang/stock_check.py --url http://127.0.0.1:30000

The plugin is loaded into every SGLang process of an image that has it (its `sglang.srt.plugins` entry point),
so a server launched without aux capture still runs the plugin's middleware. That server must stay stock SGLang:

- `/health` answers 200 once SGLang's warm-up passed (the warm-up reads `/model_info`, which the plugin hands to
  SGLang itself on such a server);
- `/model_info` and `/get_model_info` are SGLang's own (without the protocol's `capture_aux_layer_ids`);
- a plain `/generate` of token ids is answered by SGLang (JSON with `output_ids`);
- a `/generate` with `capture` is answered 503 with a message that names the launch flag it needs. A 200 means the
  plugin is not loaded (SGLang ignores the unknown field and decodes): the capture would be silently lost.

Exit status: 0 all good, 1 a check failed, 2 the check could not run (no server at the URL).
"""

import argparse
import sys
import time
from dataclasses import dataclass

import httpx

CAPTURE_FLAG = "--enable-return-aux-hidden-states"
PROMPT = [10, 11, 12, 13, 14, 15, 16, 17]  # token ids inside any vocabulary, clear of special tokens


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def wait_healthy(client: httpx.Client, timeout_s: float) -> bool:
    """True once `/health` answers 200: SGLang finished its start and its warm-up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if client.get("/health").status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(2)
    return False


def run_checks(client: httpx.Client) -> list[Check]:
    """The stock server's answers, one Check each; `client` has the server's base URL."""
    checks = []
    for path in ("/model_info", "/get_model_info"):
        response = client.get(path)
        answer = response.json() if response.status_code == 200 else {}
        ok = response.status_code == 200 and "model_path" in answer and "capture_aux_layer_ids" not in answer
        checks.append(Check(f"GET {path} is SGLang's own", ok, f"{response.status_code} {response.text[:200]}"))

    plain = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    response = client.post("/generate", json=plain)
    ok = response.status_code == 200 and isinstance(response.json().get("output_ids"), list)
    checks.append(Check("plain /generate is answered by SGLang", ok, f"{response.status_code} {response.text[:200]}"))

    capture = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "capture": {"aux_layer_ids": [0, 1, 2], "transport": "body"},
    }
    response = client.post("/generate", json=capture)
    message = response.text[:300]
    if response.status_code == 200:
        message = "answered 200: the plugin is not loaded, and SGLang decoded the prompt without capturing it"
    ok = response.status_code == 503 and CAPTURE_FLAG in response.text
    checks.append(Check(f"capture /generate is refused 503 naming {CAPTURE_FLAG}", ok, message))
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the stock SGLang server, e.g. http://127.0.0.1:30000")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="wait this long for /health, per request too")
    args = parser.parse_args(argv)

    with httpx.Client(base_url=args.url, timeout=args.timeout_s) as client:
        if not wait_healthy(client, args.timeout_s):
            print(f"stock check could not run: {args.url}/health did not answer 200 within {args.timeout_s:.0f} s")
            return 2
        checks = run_checks(client)
    for check in checks:
        print(f"{'ok  ' if check.ok else 'FAIL'} {check.name}: {check.detail}")
    ok = all(check.ok for check in checks)
    print("stock check passed" if ok else "stock check FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

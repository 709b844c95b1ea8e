"""The inference client against a real server process that is slow, and one that hangs (SIGSTOP: the kernel still
accepts connections, nothing answers). The fault suite runs the same against the reference server at the default
EAGLE3_INFERENCE_HEALTH_TIMEOUT_S (tests/faults/test_dependencies.py); here the health timeout is 2 s so that the
two cases take seconds."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from shared.capture.client import InferenceClient
from shared.errors import InferenceUnavailable
from tests.fixtures.processes import free_port, wait_until

# /health answers at once; /generate takes SLOW_S, as a long prefill does.
SERVER = """
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(float(sys.argv[2]))
        body = json.dumps({"text": "slow but fine", "meta_info": {}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""
SLOW_S = 6.0
HEALTH_TIMEOUT_S = 2.0


@pytest.fixture
def server() -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(SLOW_S)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, timeout_s=20)
        yield url, process
    finally:
        os.kill(process.pid, signal.SIGCONT)
        process.kill()
        process.wait()


def test_a_slow_request_of_a_server_that_answers_health_is_waited_for(server: tuple[str, subprocess.Popen]) -> None:
    url, _ = server
    with InferenceClient(url, timeout_s=300, health_timeout_s=HEALTH_TIMEOUT_S) as client:
        started = time.monotonic()
        answer = client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})
        assert answer == {"text": "slow but fine", "meta_info": {}}
        assert time.monotonic() - started >= SLOW_S  # three times the health timeout, and not abandoned


def test_a_request_to_a_hung_server_is_abandoned_long_before_its_timeout(
    server: tuple[str, subprocess.Popen],
) -> None:
    url, process = server
    with InferenceClient(url, timeout_s=300, health_timeout_s=HEALTH_TIMEOUT_S) as client:
        os.kill(process.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(InferenceUnavailable, match="the server hangs: its /health has not answered"):
            client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})
        waited_s = time.monotonic() - started
        assert HEALTH_TIMEOUT_S <= waited_s < HEALTH_TIMEOUT_S + 5, waited_s
        os.kill(process.pid, signal.SIGCONT)
        # The abandoned request kept its connection; the next one gets a fresh pool and goes through.
        answer = client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})
        assert answer["text"] == "slow but fine"

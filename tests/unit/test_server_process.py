"""The SGLang process helper with real child processes (small HTTP servers in SGLang's place): several start at
once and are all stopped, with their children; one that dies before it is healthy is reported with its log."""

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from eagle3.local_stack import free_port
from eagle3.server_process import ServerLaunch, ServerProcessError, group_running, server_processes

# A server that answers /health after a moment, with a child process of its own (as SGLang's scheduler is).
SERVER = """
import http.server, os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("child", child.pid, flush=True)
time.sleep(0.5)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def launch(tmp_path: Path, name: str, code: str = SERVER) -> ServerLaunch:
    port = free_port()
    return ServerLaunch(["-c", code, str(port)], f"http://127.0.0.1:{port}", tmp_path / f"{name}.log")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_servers_start_together_and_stop_with_their_children(tmp_path: Path) -> None:
    launches = [launch(tmp_path, "a"), launch(tmp_path, "b")]
    with server_processes(launches, python=sys.executable, start_timeout_s=60) as urls:
        assert urls == [item.url for item in launches]
        assert all(httpx.get(f"{url}/health").status_code == 200 for url in urls)
        children = [int(item.log.read_text().split()[1]) for item in launches]
        assert all(alive(pid) for pid in children)
    assert not any(alive(pid) for pid in children)


def test_a_server_that_dies_is_named_with_its_log_and_the_others_are_stopped(tmp_path: Path) -> None:
    healthy, dying = launch(tmp_path, "healthy"), launch(tmp_path, "dying", "import sys; sys.exit('no GPU here')")
    with (
        pytest.raises(ServerProcessError, match=r"(?s)exited with code 1.*no GPU here"),
        server_processes([healthy, dying], python=sys.executable, start_timeout_s=60),
    ):
        pass
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{healthy.url}/health", timeout=2)


def test_a_group_runs_while_a_process_of_it_runs_and_not_after() -> None:
    assert group_running(os.getpgrp())  # this test's own group
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    assert group_running(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    assert not group_running(sleeper.pid)

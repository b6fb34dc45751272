"""The server watchdog of the Slurm job (``launchers.serve``) and of the Ray launcher's server actors
(``launchers.ray.ServerHost``): the same ``server_watch.StallClock`` the local launcher runs, whose run
through the real local launcher with a SIGSTOPped vLLM is ``tests/e2e/test_faults_runtime.py``.

The watched server here is a real process answering ``/health`` over HTTP (a few lines of
``http.server``, a stand-in for vLLM, whose start costs a minute), held in the real ``ServerProcess``
and really SIGSTOPped; the watch probes it with the vLLM backend's own health request."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_executor import wait_until
from utils import free_port

from tandemrl.inference.registry import get_backend
from tandemrl.inference.server import ServerProcess
from tandemrl.launchers import serve, slurm_job
from tandemrl.launchers.ray import ServerHost
from tandemrl.launchers.server_watch import StallBounds, StallClock

HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

# Against the stopped server the watch's findings come a second apart (a probe that waits 0.5 s, then 0.5 s of
# sleep), the first at 0.5 s or later. With WARN below that, the first finding warns unless it is 2.5 s late
# (past LIMIT). The bounds (0.6, 2.0] left a 1.4 s window that a finding 0.5 s late could step over: no warning.
WARN, LIMIT = 0.1, 3.0


@pytest.fixture
def stopped_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server that answered ``/health`` once, then was SIGSTOPped; continued and stopped afterwards."""
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", HEALTH_SERVER, str(port)], stdout=out, stderr=out, start_new_session=True
        )
    server = ServerProcess(get_backend("vllm"), proc, "127.0.0.1", port, str(log))
    try:
        server.wait_healthy(timeout=60)
        os.killpg(proc.pid, signal.SIGSTOP)
        yield server
    finally:
        server.stop(grace=5)


def test_serve_reports_a_silent_server_once_then_records_the_failure(
    stopped_server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Slurm job's server step: one warning after --stall-warn, then exit 1 past --stall-limit with the
    failure in the job script's record, which ``--wait`` turns into its one line."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # outside a job: nothing to scancel
    failed = tmp_path / "job-7.failed"
    args = argparse.Namespace(
        backend="vllm", stall_warn=WARN, stall_limit=LIMIT, step="vllm-server-0", failed=str(failed),
        log=stopped_server.log_file,
    )  # fmt: skip
    assert serve.supervise(stopped_server, args) == 1
    out, err = capsys.readouterr()
    who = f"vllm server {stopped_server.address}"
    warned = [line for line in out.splitlines() if "has not answered" in line]
    assert len(warned) == 1 and warned[0].startswith(f"[serve] {who} has not answered for "), out
    assert err.startswith(f"error: {who} has not answered for ") and err.rstrip().endswith(": stopped"), err
    step, what, log = failed.read_text().rstrip("\n").split("\t")
    assert (step, log) == ("vllm-server-0", stopped_server.log_file)
    assert what.startswith("has not answered for ") and what.endswith("s (launcher.server_stall_limit)")
    line = slurm_job.failure("7", "CANCELLED", "0:0", tmp_path, 0)
    assert line == f"job 7 CANCELLED: vllm-server-0 step {what} (log: {stopped_server.log_file})"


def test_a_recorded_failure_is_kept(stopped_server: ServerProcess, tmp_path: Path) -> None:
    """The job's first failure wins: a stall after another step failed does not overwrite its record."""
    failed = tmp_path / "job-7.failed"
    failed.write_text("trainer\texited with code 1\ttrainer.log\n")
    args = argparse.Namespace(
        backend="vllm", stall_warn=0.6, stall_limit=1.2, step="vllm-server-0", failed=str(failed), log="s.log"
    )
    assert serve.supervise(stopped_server, args) == 1
    assert failed.read_text() == "trainer\texited with code 1\ttrainer.log\n"


def test_ray_server_actor_reports_a_warning_then_the_stop(stopped_server: ServerProcess) -> None:
    """The Ray launcher's server actor body (used here without Ray): after ``watch``, ``take_stall`` gives one
    warning, then the stop past the limit; each finding is handed out once."""
    host = ServerHost({})
    host._server = stopped_server
    host.watch(WARN, LIMIT)
    seen: list[tuple[str, float]] = []

    def stopped() -> bool:
        event = host.take_stall()
        if event is not None:
            seen.append(event)
        return bool(seen) and seen[-1][0] == "stop"

    wait_until(stopped, "the watch's stop", timeout=60)
    assert [what for what, _ in seen] == ["warn", "stop"]
    assert seen[0][1] > WARN and seen[1][1] > LIMIT
    assert host.take_stall() is None


def test_a_silence_is_reported_before_it_stops_the_run() -> None:
    """Whatever the spacing of the probes: a first silent probe already past the limit warns, the next one
    stops; an answer starts a new silence, which warns again."""
    clock = StallClock(StallBounds(warn=1.0, limit=3.0), now=0.0)
    assert clock.observe(False, now=0.5) is None
    assert clock.observe(False, now=10.0) == ("warn", 10.0)
    assert clock.observe(False, now=10.5) == ("stop", 10.5)
    assert clock.observe(True, now=11.0) is None
    assert clock.observe(False, now=12.5) == ("warn", 1.5)
    assert clock.observe(False, now=13.0) is None
    assert clock.observe(False, now=14.5) == ("stop", 3.5)

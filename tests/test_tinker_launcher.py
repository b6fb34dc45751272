"""``tandemrl tinker-serve`` as a launcher job (examples/tinker_serve.py, examples/tinker_serve.yaml) under the local
launcher and the Ray launcher (a one-node Ray cluster it starts): the launcher starts the LoRA-enabled vLLM server
and the tinker-serve process, the unmodified SDK trains through it, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import tinker
from tinker import types
from utils import REPO_ROOT

pytestmark = pytest.mark.slow
READY = re.compile(r"TINKER_BASE_URL=(\S+) TINKER_API_KEY=(\S+)")


def sdk_cross_entropy(base_url: str, api_key: str, base_model: str) -> float:
    """The ``loss:sum`` of one cross_entropy ``forward_backward`` of a new LoRA client, through the ``tinker`` SDK."""
    telemetry = os.environ.get("TINKER_TELEMETRY")
    os.environ["TINKER_TELEMETRY"] = "0"
    try:
        sc = tinker.ServiceClient(base_url=base_url, api_key=api_key)
        tc = sc.create_lora_training_client(base_model=base_model, rank=4).result()
        tokens = [5, 17, 42, 99, 7, 23, 61, 88]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        loss = float(tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
        sc.close("success").result(timeout=60)  # finish the session, or its heartbeat warns once the job ends
        return loss
    finally:
        if telemetry is None:
            os.environ.pop("TINKER_TELEMETRY", None)
        else:
            os.environ["TINKER_TELEMETRY"] = telemetry


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    out: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line)
        out.put("")  # end of output

    threading.Thread(target=pump, daemon=True).start()
    return out


def _wait_ready(proc: subprocess.Popen[str], lines: queue.Queue[str], seen: list[str]) -> re.Match[str]:
    while True:
        line = lines.get(timeout=900)
        seen.append(line)
        if not line:
            raise AssertionError(f"launcher exited ({proc.poll()}) before serving:\n{''.join(seen)[-4000:]}")
        match = READY.search(line)
        if match:
            return match


@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_launcher_serves_the_tinker_api_and_stops_every_process(
    launcher: str, tiny_model_dir: str, tmp_path: Path
) -> None:
    """The launcher prints the base URL and key; a forward_backward through the SDK returns a positive
    cross-entropy; after Ctrl-C the launcher exits 130 and every process it started (the vLLM server, the
    tinker-serve rank, under Ray the cluster's processes) is gone."""
    cmd = [sys.executable, "-m", f"tandemrl.launchers.{launcher}", "examples/tinker_serve.py"]
    cmd += ["--config", "examples/tinker_serve.yaml", f"model.path={tiny_model_dir}", f"cluster.fileroot={tmp_path}"]
    cmd += ["tinker.max_adapters=2", "launcher.server_args.max_loras=2"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TINKER_TELEMETRY": "0"}
    env.pop("RAY_ADDRESS", None)  # the Ray launcher starts its own one-node cluster
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    children: list[psutil.Process] = []
    try:
        seen: list[str] = []
        ready = _wait_ready(proc, _lines(proc), seen)
        children = psutil.Process(proc.pid).children(recursive=True)
        cmdlines = [" ".join(c.cmdline()) for c in children]
        assert any("vllm" in c for c in cmdlines) and any("tinker_serve.py" in c for c in cmdlines), cmdlines
        assert sdk_cross_entropy(ready.group(1), ready.group(2), tiny_model_dir) > 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(180) == 130
        _, alive = psutil.wait_procs(children, timeout=60)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        for child in children:
            if child.is_running():
                child.kill()

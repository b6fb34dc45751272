"""``tandemrl tinker-serve`` as a launcher job (examples/tinker_serve.py, examples/tinker_serve.yaml) under the local
launcher (two data-parallel training ranks under torchrun) and the Ray launcher (a one-node Ray cluster it starts,
one rank): the launcher starts the LoRA-enabled vLLM server and the tinker-serve ranks, the unmodified SDK trains
through them, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import json
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
import torch
from safetensors.torch import load_file
from tinker import types
from utils import REPO_ROOT

pytestmark = pytest.mark.slow
READY = re.compile(r"TINKER_BASE_URL=(\S+) TINKER_API_KEY=(\S+)")
# three sequences of different lengths: with two ranks one takes two of them, the other one
TRAINING = {
    "rank": 4,
    "seed": 7,
    "lr": 1e-2,
    "steps": 2,
    "seqs": [[5, 17, 42, 99, 7, 23, 61, 88], [3, 9, 27, 81, 243], [11, 22, 33, 44, 55, 66, 77, 88, 99, 110, 121]],
}
FP32_TOL = 1e-5  # DP=2 sums the same fp32 gradient in another order (measured: 4e-7 after 3 steps at lr 1e-2)


def sdk_training(base_url: str, api_key: str, base_model: str) -> float:
    """TRAINING through the ``tinker`` SDK: a new LoRA client, its steps, its state saved as ``dp``; the
    ``loss:sum`` of its first ``forward_backward``."""
    telemetry = os.environ.get("TINKER_TELEMETRY")
    os.environ["TINKER_TELEMETRY"] = "0"
    try:
        sc = tinker.ServiceClient(base_url=base_url, api_key=api_key)
        tc = sc.create_lora_training_client(base_model=base_model, rank=TRAINING["rank"], seed=TRAINING["seed"])
        tc = tc.result() if hasattr(tc, "result") else tc
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
            )
            for seq in TRAINING["seqs"]
        ]
        losses = []
        for _ in range(TRAINING["steps"]):
            losses.append(float(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]))
            tc.optim_step(types.AdamParams(learning_rate=TRAINING["lr"])).result()
        tc.save_state("dp").result()
        sc.close("success").result(timeout=60)  # finish the session, or its heartbeat warns once the job ends
        assert losses[1] < losses[0], losses
        return losses[0]
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


def _same_as_one_rank(tmp_path: Path, model_dir: str) -> None:
    """The adapter and AdamW state the job saved equal TRAINING on one rank (tinker_dp_reference.py) within
    FP32_TOL, and training moved the adapter (its B started at zero)."""
    (saved,) = list(tmp_path.glob("logs/**/weights/dp"))
    ref = tmp_path / "reference"
    script = str(REPO_ROOT / "tests" / "tinker_dp_reference.py")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    subprocess.run(
        [sys.executable, script, model_dir, str(ref), json.dumps(TRAINING)], env=env, check=True, timeout=600
    )
    two, one = load_file(saved / "adapter_model.safetensors"), load_file(ref / "adapter_model.safetensors")
    assert two.keys() == one.keys() and len(one) == 28  # 7 target linears in each of the tiny model's 2 layers
    assert max(float(t.abs().max()) for k, t in one.items() if "lora_B" in k) > 100 * FP32_TOL
    for key, t in one.items():
        torch.testing.assert_close(two[key], t, atol=FP32_TOL, rtol=0, msg=key)
    opt_two, opt_one = torch.load(saved / "optimizer.pt"), torch.load(ref / "optimizer.pt")
    assert opt_two["steps"] == opt_one["steps"] == TRAINING["steps"]
    for key, state in opt_one["optimizer"].items():
        for name, t in state.items():
            torch.testing.assert_close(opt_two["optimizer"][key][name], t, atol=FP32_TOL, rtol=1e-4, msg=key)


@pytest.mark.parametrize(("launcher", "dp"), [("local", 2), ("ray", 1)])
def test_launcher_serves_the_tinker_api_and_stops_every_process(
    launcher: str, dp: int, tiny_model_dir: str, tmp_path: Path
) -> None:
    """The launcher prints the base URL and key; two cross_entropy steps through the SDK lower the loss; with two
    torchrun ranks (fsdp:d2) the saved adapter and optimizer state equal one rank's within fp32 tolerance; after
    Ctrl-C the launcher exits 130 and every process it started (the vLLM server, the tinker-serve ranks, under Ray
    the cluster's processes) is gone."""
    cmd = [sys.executable, "-m", f"tandemrl.launchers.{launcher}", "examples/tinker_serve.py"]
    cmd += ["--config", "examples/tinker_serve.yaml", f"model.path={tiny_model_dir}", f"cluster.fileroot={tmp_path}"]
    cmd += ["tinker.max_adapters=2", "launcher.server_args.max_loras=2", f"allocation_mode=vllm:d1+fsdp:d{dp}"]
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
        assert sdk_training(ready.group(1), ready.group(2), tiny_model_dir) > 0
        if dp > 1:
            _same_as_one_rank(tmp_path, tiny_model_dir)
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

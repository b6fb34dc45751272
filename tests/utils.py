"""Helpers shared by tests: free ports and torchrun launches (importable as `from utils import ...`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# How a torchrun agent process shows in a command line: the local launcher's loopback torchrun
# (tandemrl.launchers.torchrun_loopback), or plain torch.distributed.run (Slurm, tests).
TORCHRUN_MODULES = ("torch.distributed.run", "tandemrl.launchers.torchrun_loopback")


# What a launched run in the tests gets (the e2e prelude): wandb quiet, a generous rendezvous timeout, the repo
# importable by the children.
LAUNCH_ENV = {**os.environ, "WANDB_SILENT": "true", "TANDEMRL_DIST_TIMEOUT": "300", "PYTHONPATH": str(REPO_ROOT)}
LOCAL_LAUNCHER = "tandemrl.launchers.local"


def launch(
    args: Sequence[str],
    timeout: float,
    *,
    launcher: str = LOCAL_LAUNCHER,
    server: Any = None,
    merged: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``python -m <launcher> ARGS`` from the repository with :data:`LAUNCH_ENV`, as a user runs it; on ``server``
    (the ``running_server`` fixture: its ``rollout.server_addrs`` overrides and token) when given, so the launch
    starts no server of its own; ``merged`` puts stderr into stdout, as a terminal shows them."""
    cmd = [sys.executable, "-m", launcher, *args, *(server.overrides if server is not None else [])]
    env = {**LAUNCH_ENV, **(server.env if server is not None else {})}
    stderr = subprocess.STDOUT if merged else subprocess.PIPE
    return subprocess.run(
        cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=timeout
    )


def is_torchrun(cmdline: str) -> bool:
    """Whether a process command line is a torchrun agent (not one of its ranks)."""
    return any(m in cmdline for m in TORCHRUN_MODULES)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (never a fixed number; outside the kernel's
    ephemeral range, see tandemrl/api/net.py)."""
    from tandemrl.api.net import free_port as _free_port

    return _free_port("127.0.0.1")


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def run_torchrun(
    script: str | os.PathLike[str],
    nproc: int = 2,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run `script` (a .py path, or a dotted module name) under torchrun --standalone.

    Children get OMP_NUM_THREADS=1 and the repo on PYTHONPATH. Raises RuntimeError with the
    tail of stdout/stderr if the run fails or times out.
    """
    target = os.fspath(script)
    is_file = target.endswith(".py") or os.path.sep in target
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [target] if is_file else ["-m", target]
    cmd += [str(a) for a in args]
    child_env = dict(os.environ)
    child_env["OMP_NUM_THREADS"] = "1"
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), child_env.get("PYTHONPATH", "")) if p)
    child_env.update(env or {})
    try:
        proc = subprocess.run(cmd, env=child_env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise RuntimeError(
            f"torchrun {target} timed out after {timeout}s\n--- stdout ---\n{_tail(out)}\n--- stderr ---\n{_tail(err)}"
        ) from None
    if proc.returncode != 0:
        raise RuntimeError(
            f"torchrun {target} exited with {proc.returncode}\n--- stdout ---\n{_tail(proc.stdout)}\n"
            f"--- stderr ---\n{_tail(proc.stderr)}"
        )
    return proc


# bf16 compute over fp32 master weights vs fp32 compute, 5 SFT steps of the tiny model at lr 1e-3 on the
# same batches (tests/workers/fsdp_checks.py: precision_run): the largest relative loss gap measured was
# ~9e-5 (FSDP2, DeepSpeed ZeRO-1/3, Megatron DP=2); the bound leaves 10x margin. docs/precision.md.
BF16_LOSS_RTOL = 1e-3


def assert_bf16_tracks_fp32(fp32: dict, bf16: dict) -> None:
    """bf16 losses within BF16_LOSS_RTOL of fp32 at every step, yet computed differently; log-probs and the
    optimizer's weights and moments in fp32 (``precision_run`` results of the two engines)."""
    gaps = [abs(b - a) / abs(a) for a, b in zip(fp32["losses"], bf16["losses"], strict=True)]
    assert len(gaps) == 5 and max(gaps) < BF16_LOSS_RTOL, gaps
    assert bf16["losses"] != fp32["losses"], "bf16 compute must change the numerics"
    assert fp32["losses"][-1] < fp32["losses"][0]
    for run in (fp32, bf16):
        assert run["logp_dtype"] == "torch.float32"
        assert run["optimizer_dtypes"] == ["torch.float32"]


def assert_prefix_sharing_exact(res: dict) -> None:
    """``prefix_checks.shared_vs_unshared`` results: the shared layout ran fewer tokens, and logprobs, loss,
    grad norm and every weight's gradient equal the unshared layout's within 1e-5 (fp32)."""
    off, on = res["off"], res["on"]
    assert on["tokens"] < 0.75 * off["tokens"], (on["tokens"], off["tokens"])
    assert (on["logp"] - off["logp"]).abs().max().item() < 1e-5
    assert abs(on["loss"] - off["loss"]) < 1e-5 and off["loss"] != 0.0
    assert abs(on["grad_norm"] - off["grad_norm"]) < 1e-5
    assert off["grads"].keys() == on["grads"].keys() and off["grads"]
    largest = max(g.abs().max().item() for g in off["grads"].values())
    diff = max((on["grads"][k] - g).abs().max().item() for k, g in off["grads"].items())
    print(f"prefix sharing: max |grad| {largest:.3e}, max |grad diff| {diff:.3e}")
    assert largest > 0 and diff < 1e-5 and diff < 1e-3 * largest, (diff, largest)

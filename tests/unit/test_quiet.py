"""Quiet by default: library progress bars and harmless warnings are off in our processes and their children."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandemrl.utils import quiet

CHILD = """
import warnings, datasets, os
warnings.warn("'set_vital' is deprecated, please do not call", UserWarning)
warnings.warn("something a user should see", UserWarning)
from datasets.utils.logging import is_progress_bar_enabled
print("bars", "on" if is_progress_bar_enabled() else "off", os.environ.get("TRANSFORMERS_VERBOSITY"))
"""


def _child_after_quiet(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A process that calls quiet_process(), then starts a child that imports datasets and warns twice."""
    code = (
        f"from tandemrl.utils.quiet import quiet_process; quiet_process(); import subprocess, sys; "
        f"sys.exit(subprocess.run([sys.executable, '-c', {CHILD!r}]).returncode)"
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("verbose", [False, True])
def test_children_inherit_quiet_unless_verbose(verbose: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (*quiet.QUIET_ENV, "PYTHONWARNINGS", quiet.VERBOSE_ENV)}
    if verbose:
        env[quiet.VERBOSE_ENV] = "1"
    proc = _child_after_quiet(env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # A warning nobody listed always shows; the known-harmless one only in verbose mode.
    assert "something a user should see" in proc.stderr
    assert ("set_vital" in proc.stderr) == verbose, proc.stderr
    assert proc.stdout.split() == (["bars", "on", "None"] if verbose else ["bars", "off", "error"]), proc.stdout


def test_a_users_own_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")
    monkeypatch.setenv("PYTHONWARNINGS", "error::DeprecationWarning")
    quiet.quiet_process()
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "info"
    assert os.environ["PYTHONWARNINGS"].startswith("error::DeprecationWarning,ignore:'set_vital' is deprecated")


DS_CHILD = """
import os
os.environ.pop("DS_ACCELERATOR", None)
from tandemrl.utils.quiet import quiet_process
quiet_process()
import deepspeed  # on a machine without CUDA its accelerator probe logs 'Setting accelerator to CPU'
from deepspeed.utils import logger
logger.warning("a DeepSpeed warning a user should see")
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_deepspeed_cpu_accelerator_notice_is_quiet_unless_verbose(verbose: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", quiet.VERBOSE_ENV)}
    env["CUDA_VISIBLE_DEVICES"] = ""  # as on this CPU machine, also where a GPU is present
    if verbose:
        env[quiet.VERBOSE_ENV] = "1"
    proc = subprocess.run([sys.executable, "-c", DS_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "a DeepSpeed warning a user should see" in out  # other DeepSpeed warnings still show
    assert ("Setting accelerator to CPU" in out) == verbose, out[-2000:]


LATE_CHILD = """
import datasets, huggingface_hub  # imported before quiet_process, as a bench script's top-level imports do
from tandemrl.utils.quiet import quiet_process
quiet_process()
print(datasets.is_progress_bar_enabled(), huggingface_hub.utils.are_progress_bars_disabled())
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_bars_of_libraries_imported_before_quiet_are_switched_off(verbose: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in quiet.QUIET_ENV and k != quiet.VERBOSE_ENV}
    if verbose:
        env[quiet.VERBOSE_ENV] = "1"
    proc = subprocess.run([sys.executable, "-c", LATE_CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == (["True", "False"] if verbose else ["False", "True"])


BACKEND_CHILD = """
import os
import warnings

import torch
import torch.distributed as dist

import megatron.core.models.backends, megatron.core.optimizer  # Apex / TransformerEngine fallback notices

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group(world_size=1, rank=0)  # the default backend for this machine's devices
t, out = torch.zeros(2), torch.zeros(2)
dist.all_gather_into_tensor(out, t)  # torch's deprecation warnings, as DeepSpeed's and Megatron's calls give
dist.reduce_scatter_tensor(t, out)
dist.destroy_process_group()
warnings.warn("a backend warning a user should see", UserWarning)
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_training_backends_notices_are_quiet_unless_verbose(verbose: bool) -> None:
    """What a DeepSpeed or Megatron rank prints on a machine without CUDA: torch's collective deprecations and
    Megatron's Apex/TransformerEngine fallbacks, from a child of a quieted process (as the ranks are)."""
    from utils import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", quiet.VERBOSE_ENV)}
    env["PORT"] = str(free_port())
    if verbose:
        env[quiet.VERBOSE_ENV] = "1"
    code = (
        "from tandemrl.utils.quiet import quiet_process; quiet_process(); import subprocess, sys; "
        f"sys.exit(subprocess.run([sys.executable, '-c', {BACKEND_CHILD!r}]).returncode)"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "a backend warning a user should see" in proc.stderr
    for notice in ("is deprecated. Please use `torch.distributed", "Apex is not installed", "Apex are not installed"):
        assert (notice in proc.stderr) == verbose, (notice, proc.stderr[-3000:])


WANDB_CHILD = """
import wandb
run = wandb.init(mode="offline", project="quiet", dir=".")
run.log({"reward": 0.5})
run.finish()
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_wandb_banner_and_summary_are_quiet_unless_verbose(verbose: bool, tmp_path) -> None:
    """A child of a quieted process (a trainer rank) logs to wandb without wandb's lines on the console."""
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_SILENT", quiet.VERBOSE_ENV)}
    if verbose:
        env[quiet.VERBOSE_ENV] = "1"
    code = (
        "from tandemrl.utils.quiet import quiet_process; quiet_process(); import subprocess, sys; "
        f"sys.exit(subprocess.run([sys.executable, '-c', {WANDB_CHILD!r}]).returncode)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("wandb" in proc.stdout + proc.stderr) == verbose, proc.stdout + proc.stderr
    assert list(tmp_path.glob("wandb/offline-run-*"))  # the run was logged either way

"""scripts/gpu_check.sh --cpu: the GPU check's dry run on the CPU (gloo, world sizes 1 and 2).

Every check prints one line; what can run on the CPU must report ok, and only what needs CUDA (or
a second device) may skip. About 50 s on 2 idle cores (minutes on a loaded machine): five torchrun launches,
the whole parity table among them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from utils import REPO_ROOT

pytestmark = pytest.mark.slow

SCRIPT = REPO_ROOT / "scripts" / "gpu_check.sh"
LINE = re.compile(r"^CHECK (\S+) (ok|skip|FAIL)\b(.*)$")
# Checks that must run (and pass) on a CPU with 2 cores.
CPU_CHECKS = (
    "fsdp2_sft_bf16_ws1",
    "fsdp2_sft_bf16_ws2",
    "deepspeed_zero3_bf16_ws1",
    "megatron_tp1_local_bf16",
    "parity_fsdp",
    "parity_deepspeed-zero3",
    "parity_megatron-t2",
    "fsdp2_mfu_bf16",
)


@pytest.fixture(scope="module")
def dry_run(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHON": sys.executable, "TANDEMRL_DIST_TIMEOUT": "120"}
    cmd = ["bash", str(SCRIPT), "--cpu", "--model", tiny_model_dir, "--out", str(out)]
    return subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)


def _lines(proc: subprocess.CompletedProcess[str]) -> dict[str, tuple[str, str]]:
    found = {}
    for line in proc.stdout.splitlines():
        m = LINE.match(line)
        if m:
            found[m.group(1)] = (m.group(2), m.group(3).strip())
    return found


def test_every_check_line_is_ok_or_a_justified_skip(dry_run: subprocess.CompletedProcess[str]) -> None:
    lines = _lines(dry_run)
    assert dry_run.returncode == 0, dry_run.stdout[-4000:] + dry_run.stderr[-4000:]
    assert len(lines) >= len(CPU_CHECKS) + 1, dry_run.stdout
    for name, (status, rest) in lines.items():
        if status == "skip":
            assert "CUDA" in rest or "devices" in rest, f"{name}: unexpected skip {rest}"
        else:
            assert status == "ok", f"{name}: {status} {rest}"
    for name in CPU_CHECKS:
        assert lines.get(name, ("missing",))[0] == "ok", f"{name}: {lines.get(name)}"
    assert lines["megatron_tp1_te_bf16"][0] == "skip"


def test_lines_name_the_detected_backend(dry_run: subprocess.CompletedProcess[str]) -> None:
    """With the GPUs hidden the engines pick gloo and the CPU themselves; SFT losses fall."""
    lines = _lines(dry_run)
    status, rest = lines["fsdp2_sft_bf16_ws2"]
    assert "gloo, cpu, world 2" in rest, rest
    first, last = map(float, re.search(r"loss (\S+)->(\S+) ", rest).groups())
    assert last < first
    assert "world 2" in lines["parity_megatron-p2"][1]
    assert "# device: cpu" in dry_run.stdout


def test_parity_rows_skip_on_a_model_whose_vocab_is_too_small(tmp_path) -> None:
    """The parity rows draw token ids up to ppo_checks.VOCAB: a smaller model (e.g. the tiny Qwen2 built
    without GSM8K) gets a skip line naming the vocab, not an IndexError from the embedding per row."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO_ROOT / "scripts"))
    (tmp_path / "config.json").write_text('{"vocab_size": 512}')
    reason = gpu_check.parity_vocab_skip(str(tmp_path))
    assert "vocab_size >= 1024" in reason and "has 512" in reason, reason
    (tmp_path / "config.json").write_text('{"vocab_size": 1024}')
    assert gpu_check.parity_vocab_skip(str(tmp_path)) == ""

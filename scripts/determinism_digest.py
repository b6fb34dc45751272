"""Fingerprint a deterministic GRPO run, to compare two commits (a refactor must change no result).

    python scripts/determinism_digest.py [--steps 3] [--out DIR]

Runs what ``tests/e2e/test_determinism_launcher.py`` runs, once per mode: the GRPO example with a dense reward
(``tests/workers/grpo_dense_reward.py``) on the tiny test model, ``deterministic=true``, sync and async, through
the local launcher. Prints one line per mode: the SHA-256 of its logged scalars (``stats.jsonl`` without timings,
rounded to nothing: exact floats) and of its final weights. Equal lines on two commits: the same run, bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Scalars that measure time (or bytes per second) differ between identical runs by nature.
TIMING = (
    "timeperf/",
    "weight_sync/seconds",
    "weight_sync/gb_per_s",
    "server_busy",
    "pipeline/trainer_idle",
    "pipeline/server_idle",
    "pipeline/weight_sync",
    "env_wait",
)


def scalars_digest(stats: Path) -> str:
    rows = [json.loads(line) for line in stats.read_text().splitlines() if line.strip()]
    kept = [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def weights_digest(ckpt: Path) -> str:
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"determinism_digest: no safetensors in {ckpt}")
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="", help="run directory (default: a temporary one)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import gsm8k_path, tiny_model_cache_dir

    from tandemrl.models.make_tiny import ensure_tiny_model

    data = str(gsm8k_path())
    model = ensure_tiny_model(tiny_model_cache_dir(), "qwen2", corpus_path=data)
    out = Path(args.out or tempfile.mkdtemp(prefix="tandemrl-digest-")).resolve()
    steps = args.steps
    cmd = [sys.executable, "-m", "tandemrl.launchers.local", "tests/workers/grpo_dense_reward.py"]
    cmd += ["--config", "examples/gsm8k_grpo.yaml", f"actor.engine.path={model}", f"train_dataset.path={data}"]
    cmd += [f"cluster.fileroot={out}", f"total_train_steps={steps}", "rollout.max_head_offpolicyness=1"]
    cmd += ["valid_dataset.max_samples=8", "gconfig.max_new_tokens=16", f"evaluator.freq_steps={steps}"]
    cmd += ["deterministic=true", "--multirun", "async_training=false,true"]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # this tree's tandemrl
    env = {
        **os.environ,
        "PYTHONPATH": path,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"determinism_digest: the run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    for mode in ("false", "true"):
        trial = f"trial0_async_training{mode}"
        logs = out / "logs" / "gsm8k-grpo" / trial
        ckpt = out / "checkpoints" / "gsm8k-grpo" / trial / f"epoch0epochstep{steps - 1}globalstep{steps - 1}"
        print(
            f"commit {commit.stdout.strip()} async_training={mode} steps={steps} "
            f"scalars {scalars_digest(logs / 'stats.jsonl')[:16]} weights {weights_digest(ckpt)[:16]}"
        )


if __name__ == "__main__":
    main()

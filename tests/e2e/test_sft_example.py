"""End to end: the GSM8K SFT example on 2 gloo ranks learns, logs and checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
from utils import REPO_ROOT, run_torchrun


@pytest.mark.slow
def test_sft_gsm8k_two_ranks(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_torchrun(
        REPO_ROOT / "examples" / "gsm8k_sft.py",
        2,
        [
            "--config",
            REPO_ROOT / "examples" / "gsm8k_sft.yaml",
            f"model.path={tiny_model_dir}",
            f"train_dataset.path={gsm8k_dir}",
            "train_dataset.max_samples=1200",
            f"cluster.fileroot={tmp_path}",
            "total_train_steps=30",
            "model.optimizer.lr=3e-3",
            "saver.freq_steps=15",
            "evaluator.freq_steps=15",
        ],
        env={"WANDB_SILENT": "true", "TANDEMRL_DIST_TIMEOUT": "120"},
        timeout=600,
    )
    tb = tmp_path / "tensorboard" / "gsm8k-sft" / "trial0"
    acc = EventAccumulator(str(tb))
    acc.Reload()
    losses = [e.value for e in acc.Scalars("sft/loss")]
    assert len(losses) == 30
    assert losses[-1] <= 0.7 * losses[0], losses
    assert "eval_loss" in acc.Tags()["scalars"]
    # wandb ran in offline mode and wrote its run directory
    assert list((tmp_path / "logs" / "gsm8k-sft" / "trial0").glob("wandb/offline-run-*"))
    # HF checkpoints written by the Saver reload in transformers
    ckpts = sorted((tmp_path / "checkpoints" / "gsm8k-sft" / "trial0").iterdir())
    assert [c.name for c in ckpts] == ["epoch0epochstep14globalstep14", "epoch0epochstep29globalstep29"]
    model = AutoModelForCausalLM.from_pretrained(ckpts[-1])
    tok = AutoTokenizer.from_pretrained(ckpts[-1])
    assert model.config.vocab_size >= len(tok)

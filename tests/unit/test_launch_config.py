"""The launcher reads a script's config with the scripts' own loader: same values, same defaults, same errors."""

from __future__ import annotations

import pytest
from utils import REPO_ROOT

from tandemrl.configs import ConfigError, GRPOConfig, SFTConfig
from tandemrl.launchers.launch_config import read_launch_spec
from tandemrl.trainers.entry import load_config

GRPO_YAML = str(REPO_ROOT / "examples" / "gsm8k_grpo.yaml")
SFT_YAML = str(REPO_ROOT / "examples" / "gsm8k_sft.yaml")


@pytest.mark.parametrize(
    "overrides",
    [[], ["experiment_name=e1", "trial_name=t7", "cluster.fileroot=/tmp/x", "weight_update_mode=disk"]],
)
def test_launch_spec_holds_the_values_and_defaults_the_script_gets(overrides: list[str]) -> None:
    argv = ["allocation_mode=vllm:d1+fsdp:d1", *overrides]
    spec = read_launch_spec(None, argv)
    config, _ = load_config(argv, GRPOConfig)
    assert spec.server_timeout == config.rollout.setup_timeout
    assert (spec.experiment_name, spec.trial_name, spec.fileroot, spec.weight_update_mode) == (
        config.experiment_name,
        config.trial_name,
        config.cluster.fileroot,
        config.weight_update_mode,
    )
    assert spec.allocation == config.allocation


def test_launch_spec_of_shipped_rl_and_sft_configs() -> None:
    rl, _ = load_config(["--config", GRPO_YAML], GRPOConfig)
    spec = read_launch_spec(GRPO_YAML, [])
    assert (spec.model_key, spec.model_path) == ("actor.engine.path", rl.actor.engine.path)
    assert spec.corpus_path == rl.train_dataset.path
    sft, _ = load_config(["--config", SFT_YAML], SFTConfig)
    spec = read_launch_spec(SFT_YAML, [])
    assert (spec.model_key, spec.model_path) == ("model.path", sft.model.path)
    assert spec.allocation.gen is None and spec.allocation == sft.allocation


def test_a_bad_value_fails_in_the_launcher_with_the_scripts_message() -> None:
    argv = ["allocation_mode=vllm:d1+fsdp:d1", "rollout.setup_timeout=soon"]
    with pytest.raises(ConfigError) as script:
        load_config(argv, GRPOConfig)
    with pytest.raises(ValueError) as launcher:
        read_launch_spec(None, argv)
    assert str(launcher.value) == str(script.value)
    assert "rollout.setup_timeout" in str(launcher.value)

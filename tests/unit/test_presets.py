"""Every shipped preset is the algorithm it names: its advantages on hand-computed groups.

A group of 4 samples with rewards 1, 0, 0, 0 and a group whose rewards are all 1; completions
of 3, 2, 4, 1 tokens. GRPO (reward - group mean) / (unbiased group std + 1e-5): mean 0.25,
std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5, so 1.5 and -0.5 on every token of each sample; the
uniform group gets 0 (batch whitening over tokens, the schema's default, gives it -0.75). SFT presets have no advantages: they must load as SFT.
"""

from __future__ import annotations

import pytest
import torch

from tandemrl.algorithms.ppo import PPOActor
from tandemrl.configs import GRPOConfig, SFTConfig
from tandemrl.configs.loader import list_presets
from tandemrl.trainers.entry import load_config

STD = 0.5 + 1e-5
GRPO_HAND = [0.75 / STD, -0.25 / STD, -0.25 / STD, -0.25 / STD, 0.0, 0.0, 0.0, 0.0]
# preset -> (schema, its required model override, per-token advantage of each of the 8 samples or None for SFT)
EXPECTED = {
    "grpo_gsm8k": (GRPOConfig, "actor.engine.path=unused", GRPO_HAND),
    "sft_gsm8k": (SFTConfig, "model.path=unused", None),
}


def _groups() -> dict[str, torch.Tensor]:
    lengths = torch.tensor([3, 2, 4, 1, 3, 2, 4, 1])
    pos, ends = torch.arange(8)[None, :], 3 + lengths[:, None]
    generated = (pos >= 3) & (pos < ends)
    return {
        "input_ids": torch.randint(10, 100, (8, 8), generator=torch.Generator().manual_seed(0)),
        "attention_mask": pos < ends,
        "loss_mask": generated.long(),
        "logprobs": torch.where(generated, -0.5, 0.0),
        "rewards": torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]),
    }


def test_every_preset_is_listed_here() -> None:
    assert sorted(list_presets()) == sorted(EXPECTED), "a new preset needs its hand-computed row in EXPECTED"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_advantages_equal_its_algorithm(name: str) -> None:
    schema, model, expected = EXPECTED[name]
    config, _ = load_config(["--config", f"preset:{name}", model], schema)
    if expected is None:
        assert not hasattr(config, "actor"), f"{name} is an SFT preset"
        return
    assert config.actor.group_size == 4, "the hand values are for groups of 4 (gconfig.n_samples)"
    batch = PPOActor(config.actor, engine=None).compute_advantages(_groups())
    adv, action = batch["advantages"], batch["action_mask"]
    for i, value in enumerate(expected):
        tokens = adv[i][action[i]]
        assert tokens.numel() == _groups()["loss_mask"][i].sum().item()
        assert torch.allclose(tokens, torch.full_like(tokens, float(value)), atol=1e-5), (name, i, tokens, value)

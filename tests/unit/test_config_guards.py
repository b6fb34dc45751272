"""Config-time guards: values that each load but do not fit together fail with one line naming the fields.

Configs load as users load them: the shipped GRPO example YAML plus command-line overrides,
through the scripts' entry (``load_script_config``).
"""

from __future__ import annotations

import pytest
from utils import REPO_ROOT

from tandemrl.configs import GRPOConfig
from tandemrl.configs.checks import first_problem
from tandemrl.configs.experiment import async_enabled
from tandemrl.configs.loader import ConfigError
from tandemrl.trainers.entry import load_script_config as load_config

GRPO_YAML = str(REPO_ROOT / "examples" / "gsm8k_grpo.yaml")


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(["--config", GRPO_YAML, *overrides], GRPOConfig)
    message = str(err.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        # staleness 0 called async
        (
            ("async_training=true", "rollout.max_head_offpolicyness=0"),
            (
                "Config key 'async_training' on the command line",
                "must be false when rollout.max_head_offpolicyness is 0",
            ),
        ),
        # truncated sampling without the replay
        (
            ("gconfig.top_p=0.8",),
            ("Config key 'gconfig.top_p' on the command line", "is 0.8", "actor.truncation_replay"),
        ),
        (("gconfig.top_k=20",), ("Config key 'gconfig.top_k' on the command line", "is 20", "actor.truncation_replay")),
        (
            ("gconfig.min_p=0.05",),
            ("Config key 'gconfig.min_p' on the command line", "is 0.05", "actor.truncation_replay"),
        ),
        # the replay with settings other than the sampler's
        (
            ("gconfig.top_p=0.8", "actor.truncation_replay=true"),
            ("Config key 'actor.top_p'", "is 1.0 but gconfig.top_p is 0.8", "set actor.top_p: ${gconfig.top_p}"),
        ),
        (
            ("actor.truncation_replay=true", "actor.top_k=20"),
            ("Config key 'actor.top_k' on the command line", "is 20 but gconfig.top_k is -1"),
        ),
        # a group of one sample under group-normalised advantages (group_size: ${gconfig.n_samples})
        (
            ("gconfig.n_samples=1",),
            ("Config key 'actor.group_size' in ", "must be > 1 when actor.adv_norm.mean_level or std_level is 'group'"),
        ),
        (
            (
                "gconfig.n_samples=1",
                "actor.adv_norm.mean_level=batch",
                "actor.adv_norm.std_level=batch",
                "actor.dynamic_sampling=true",
            ),
            ("'actor.dynamic_sampling' on the command line", "needs group_size > 1"),
        ),
        # batches that do not divide: ranks, groups, minibatches, rows, micro-batches
        (("allocation_mode=vllm:d1+fsdp:d3",), ("'train_dataset.batch_size' in ", "must be a multiple of 3")),
        (("actor.group_size=3",), ("'actor.group_size' on the command line", "must divide each rank's batch of 32")),
        (("actor.ppo_n_minibatches=9",), ("'actor.ppo_n_minibatches' on the command line", "must divide the 8 groups")),
        (("actor.ppo_n_minibatches=3",), ("'actor.ppo_n_minibatches' on the command line", "must divide the 8 groups")),
        (
            ("train_dataset.max_samples=4",),
            ("'train_dataset.max_samples' on the command line", "must be at least train_dataset.batch_size=8"),
        ),
        (
            ("actor.engine.mb_spec.max_tokens_per_mb=300",),
            (
                "'actor.engine.mb_spec.max_tokens_per_mb' on the command line",
                "must hold one whole sequence of up to 320 tokens (train_dataset.max_length=256 + "
                "gconfig.max_new_tokens=64), got 300",
            ),
        ),
    ],
)
def test_guard_is_one_line_naming_the_fields(overrides: tuple[str, ...], names: tuple[str, ...]) -> None:
    message = _error(*overrides)
    for name in names:
        assert name in message, message


def test_stale_samples_without_a_correction_are_accepted() -> None:
    """``actor.offpolicy_correction=none`` with stale samples is PPO clipped against the behaviour
    policy whatever ``recompute_logprob`` says (tests/unit/test_offpolicy.py has its gradient), so no
    combination is refused any more; before, ``never`` was refused and ``auto`` trained stale
    samples as on-policy."""
    stale = ["async_training=true", "rollout.max_head_offpolicyness=2", "actor.use_decoupled_loss=false"]
    for recompute in ("never", "auto", "always"):
        argv = [
            "--config",
            GRPO_YAML,
            *stale,
            "actor.offpolicy_correction=none",
            f"actor.recompute_logprob={recompute}",
        ]
        cfg, _ = load_config(argv, GRPOConfig)
        assert cfg.actor.offpolicy_correction == "none" and cfg.actor.recompute_logprob == recompute
        assert first_problem(cfg) is None, first_problem(cfg)


def test_async_follows_the_staleness_bound_unless_set() -> None:
    """Left null, async_training is on exactly when samples may lag; a saved default config loads again."""
    default, _ = load_config([], GRPOConfig)
    assert default.async_training is None and not async_enabled(default)
    example, _ = load_config(["--config", GRPO_YAML], GRPOConfig)
    assert example.rollout.max_head_offpolicyness == 1 and async_enabled(example)
    sync, _ = load_config(["--config", GRPO_YAML, "async_training=false"], GRPOConfig)
    assert not async_enabled(sync)
    # Greedy decoding ignores top_p/top_k, so it samples nothing truncated.
    load_config(["--config", GRPO_YAML, "gconfig.greedy=true", "gconfig.top_p=0.5"], GRPOConfig)
    # Colocated runs are sync by default now (null async with staleness 0); staleness 1 asks for overlap.
    load_config(["allocation_mode=vllm:d1|fsdp:d1"], GRPOConfig)
    assert "colocates the servers" in _error("allocation_mode=vllm:d1|fsdp:d1")


def test_truncated_sampling_with_the_replay_loads() -> None:
    """The replay on with the sampler's own settings (interpolated from gconfig) is accepted and replayed."""
    from tandemrl.algorithms.truncation import Truncation, replay_of

    truncated = ["gconfig.top_p=0.8", "gconfig.top_k=20", "gconfig.min_p=0.01", "actor.truncation_replay=true"]
    linked = ["actor.top_p=${gconfig.top_p}", "actor.top_k=${gconfig.top_k}", "actor.min_p=${gconfig.min_p}"]
    cfg, _ = load_config(["--config", GRPO_YAML, *truncated, *linked], GRPOConfig)
    assert replay_of(cfg.actor) == Truncation(top_k=20, top_p=0.8, min_p=0.01)
    # On without truncated sampling: accepted, and nothing to replay (the full-vocabulary path).
    plain, _ = load_config(["--config", GRPO_YAML, "actor.truncation_replay=true"], GRPOConfig)
    assert replay_of(plain.actor) is None


def test_a_reinforce_script_refuses_no_correction_on_async_samples_at_load() -> None:
    """What only the algorithm knows is checked at load through the script's ``checks`` (so in the launchers'
    pre-flight): REINFORCE (ReMax) has no behaviour-policy term without a correction, so ``none`` with async
    training is refused naming the key; PPO loads the same values (test above), and so does sync REINFORCE."""
    from tandemrl.algorithms.reinforce import config_problem

    remax = str(REPO_ROOT / "examples" / "gsm8k_remax.yaml")
    argv = ["--config", remax, "actor.offpolicy_correction=none"]
    cfg, _ = load_config(argv, GRPOConfig, checks=[config_problem])  # the example is synchronous
    assert not async_enabled(cfg)
    with pytest.raises(ConfigError) as err:
        load_config([*argv, "async_training=true", "rollout.max_head_offpolicyness=1"], GRPOConfig, [config_problem])
    message = str(err.value)
    assert message.startswith("Config key 'actor.offpolicy_correction' on the command line") and "\n" not in message
    assert "training is asynchronous (rollout.max_head_offpolicyness=1)" in message
    load_config([*argv[:2], "async_training=true", "rollout.max_head_offpolicyness=1"], GRPOConfig, [config_problem])

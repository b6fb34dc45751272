"""On-policy distillation's math against hand-computed values: the reverse-KL advantage, that its
policy gradient is the exact gradient of KL(student || teacher), and DistillActor's advantages
(pure, mixed with the task reward, and from recomputed student logprobs)."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch

from tandemrl.algorithms.distill import DistillActor, reverse_kl_advantages
from tandemrl.algorithms.ppo import PPOBatch
from tandemrl.configs.distill import DistillActorConfig, DistillConfig
from tandemrl.configs.ppo import NormConfig
from tandemrl.models.make_tiny import DEFAULTS, parse_tiny_spec
from tandemrl.trainers.entry import load_config


def test_reverse_kl_advantages_hand_values() -> None:
    teacher = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, -3.0, -1.0]])
    student = torch.tensor([[-1.5, -1.0, -0.5], [-0.75, -1.0, -4.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    adv = reverse_kl_advantages(teacher, student, mask, coef=2.0)
    # 2 * (teacher - student) on masked tokens, 0 elsewhere
    assert adv.tolist() == [[1.0, -2.0, 0.0], [0.0, -4.0, 6.0]]
    with pytest.raises(ValueError, match="shapes differ"):
        reverse_kl_advantages(teacher, student[:, :2], mask)


def test_policy_gradient_with_the_advantage_is_the_reverse_kl_gradient() -> None:
    """Over a 4-token vocabulary, sum_a p(a) * -A(a) * grad log p(a) (the sampled policy gradient, in
    expectation) equals grad KL(p || teacher) computed exactly by autograd."""
    logits = torch.tensor([0.3, -1.2, 2.0, 0.1], requires_grad=True)
    teacher = torch.log_softmax(torch.tensor([1.0, 0.5, -0.5, 0.0]), -1)

    logp = torch.log_softmax(logits, -1)
    (kl_grad,) = torch.autograd.grad((logp.exp() * (logp - teacher)).sum(), logits)

    logp = torch.log_softmax(logits, -1)
    adv = reverse_kl_advantages(teacher, logp.detach(), torch.ones(4, dtype=torch.bool))
    surrogate = (logp.exp().detach() * -adv * logp).sum()
    (pg_grad,) = torch.autograd.grad(surrogate, logits)
    torch.testing.assert_close(pg_grad, kl_grad, rtol=1e-6, atol=1e-7)
    assert kl_grad.abs().max() > 0.05  # a real gradient, not two zeros


def _batch() -> PPOBatch:
    """2 rows: prompt of 2 tokens, then 3 and 2 generated tokens (row 1 padded by one)."""
    loss_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 0]])
    logprobs = torch.tensor([[0.0, 0.0, -1.0, -2.0, -3.0], [0.0, 0.0, -0.5, -1.5, 0.0]])
    teacher = torch.tensor([[0.0, 0.0, -0.5, -2.5, -1.0], [0.0, 0.0, -0.5, -0.5, 0.0]])
    return cast(
        PPOBatch,
        {
            "input_ids": torch.tensor([[5, 6, 7, 8, 9], [5, 6, 10, 11, 0]]),
            "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]).bool(),
            "loss_mask": loss_mask,
            "logprobs": logprobs,
            "teacher_logprobs": teacher,
            "versions": torch.where(loss_mask.bool(), 0, -1),
            "rewards": torch.tensor([1.0, 0.0]),
        },
    )


def _actor(**fields: Any) -> DistillActor:
    config = DistillActorConfig(group_size=2, adv_norm=NormConfig(mean_level="none", std_level="none"), **fields)
    # compute_advantages reads no engine (single process, no normalization); None stands in for it.
    return DistillActor(config, engine=cast(Any, None))


def test_distill_actor_advantages_are_teacher_minus_student_per_token() -> None:
    out = _actor().compute_advantages(_batch())
    # next-token aligned: action at t emits token t + 1; teacher - behaviour on each generated token
    assert out["advantages"].tolist() == [[0.0, 0.5, -0.5, 2.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]]
    assert out["teacher_logp"].tolist() == [[0.0, -0.5, -2.5, -1.0, 0.0], [0.0, -0.5, -0.5, 0.0, 0.0]]


def test_distill_actor_mixes_the_task_reward_and_uses_recomputed_logp() -> None:
    batch = _batch()
    batch["prox_logp"] = torch.tensor([[9.0, -1.0, -2.0, -2.0, 9.0], [9.0, -1.0, -1.0, 9.0, 9.0]])
    out = _actor(distill_coef=0.5, reward_coef=2.0).compute_advantages(batch)
    # distill: 0.5 * (teacher - prox) on actions; reward: GAE with gamma = lambda = 1 and no critic gives
    # every action the sequence reward (row 0: 1, row 1: 0), times reward_coef 2
    assert out["advantages"].tolist() == [[0.0, 2.25, 1.75, 2.5, 0.0], [0.0, 0.25, 0.25, 0.0, 0.0]]


def test_distill_actor_refuses_other_temperatures_and_batches_without_teacher() -> None:
    with pytest.raises(ValueError, match=r"temperature must be 1\.0"):
        _actor(temperature=0.7)
    batch = _batch()
    del batch["teacher_logprobs"]  # type: ignore[misc]
    with pytest.raises(KeyError, match="teacher_logprobs.*TeacherScoredWorkflow"):
        _actor().compute_advantages(batch)


def test_distill_config_loads_with_teacher_addresses() -> None:
    config, _ = load_config(
        ["actor.distill_coef=0.5", "actor.reward_coef=0.1", "teacher.server_addrs=[127.0.0.1:8001]"], DistillConfig
    )
    assert (config.actor.distill_coef, config.actor.reward_coef) == (0.5, 0.1)
    assert config.teacher.server_addrs == ["127.0.0.1:8001"]


def test_tiny_spec_names_a_larger_model_with_the_same_tokenizer_recipe() -> None:
    assert parse_tiny_spec("qwen2:layers=4,hidden=256") == ("qwen2", {"layers": 4, "hidden": 256})
    assert parse_tiny_spec("") == ("qwen2", {})
    for bad in ("qwen2:layers=x", "qwen2:depth=4", "gpt2", "qwen2:hidden=130"):
        with pytest.raises(ValueError, match="tiny:"):
            parse_tiny_spec(bad)
    assert "vocab" in DEFAULTS  # the tokenizer depends on the corpus and vocab only

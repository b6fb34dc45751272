"""ReMax, PPO-with-critic and judge-rewarded examples end to end: launcher, real vLLM servers, 2 steps each."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from utils import launch
from vllm_server import RunningServer

# Cheap: tiny model, 4 prompts a step, short generations, no periodic eval until the last step.
# No periodic save either: the final model is saved because it is the last step (saver.save_final).
CHEAP = [
    "total_train_steps=2",
    "train_dataset.batch_size=4",
    "valid_dataset.max_samples=4",
    "gconfig.max_new_tokens=16",
    "saver.freq_steps=null",
    "evaluator.freq_steps=2",
]


def _scalars(tb_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _launch(
    example: str,
    overrides: list[str],
    tmp_path: Path,
    config: str = "",
    with_eval: bool = True,
    server: RunningServer | None = None,
) -> dict[str, list[float]]:
    config = config or example
    args = [f"examples/{example}.py", "--config", f"examples/{config}.yaml", f"cluster.fileroot={tmp_path}"]
    cheap = CHEAP if with_eval else [o for o in CHEAP if not o.startswith(("valid_dataset.", "evaluator."))]
    proc = launch(args + cheap + overrides, 1200, server=server)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " done: 2 steps in " in proc.stdout, proc.stdout[-2000:]
    assert " time split: rollout wait (trainer idle) " in proc.stdout, proc.stdout[-2000:]
    exp = config.replace("_", "-")
    stats = _scalars(tmp_path / "tensorboard" / exp / "trial0")
    # The server generated step 2's tokens with the weights pushed after step 1.
    assert stats["rollout_version_max"] == [0.0, 1.0], stats["rollout_version_max"]
    assert ("eval-rollout/accuracy" in stats) == with_eval, sorted(stats)
    final = tmp_path / "checkpoints" / exp / "trial0" / "epoch0epochstep1globalstep1"
    assert (final / "config.json").is_file()
    # The run's last lines say where the final model (and a recoverable checkpoint, when on) is.
    tail = [line for line in proc.stdout.strip().splitlines()[-4:] if "final model" in line]
    assert len(tail) == 1, proc.stdout[-2000:]
    assert f"final model (HF format, loadable by transformers and vLLM): {final}" in tail[0], tail[0]
    if "recover.mode=auto" in overrides:
        recover = tmp_path / "checkpoints" / exp / "trial0" / "recover"
        assert tail[0].endswith(f"; recoverable checkpoint: {recover}") and (recover / "loop_state.json").is_file()
    return stats


def _finite(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)


@pytest.mark.slow
def test_remax_example_two_steps(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path, running_server: RunningServer
) -> None:
    """The ReMax example runs 2 steps through the launcher: a finite REINFORCE loss and a real optimizer step
    each step, the greedy baseline scored each step, a recoverable final checkpoint. That the step raises
    the REINFORCE objective is asserted on a fixed batch (test_ppo_actor.py::test_reinforce_step_raises_its_objective):
    the tiny random model earns no GSM8K reward, so here every advantage is 0."""
    # recover.mode=auto with no frequency: the one recoverable checkpoint is the final one.
    overrides = [f"actor.engine.path={tiny_model_dir}", f"train_dataset.path={gsm8k_dir}", "recover.mode=auto"]
    stats = _launch("gsm8k_remax", overrides, tmp_path, server=running_server)
    assert len(stats["actor/reinforce/loss"]) == 2 and _finite(stats["actor/reinforce/loss"])
    assert _finite(stats["actor/reinforce/grad_norm"])
    assert stats["actor/reinforce/update_successful"] == [1.0, 1.0]
    assert len(stats["timeperf/actor/reinforce/fwd_bwd"]) == len(stats["timeperf/actor/reinforce/optimizer_step"]) == 2
    # The greedy baseline was generated and scored every step (a 0/1 GSM8K reward).
    greedy = stats["rollout/greedy_reward"]
    assert len(greedy) == 2 and all(0.0 <= g <= 1.0 for g in greedy), greedy
    # Launched again, the finished run says so in one line, naming its model, and starts nothing (the launcher
    # reads the checkpoint's loop state before any process starts).
    args = ["examples/gsm8k_remax.py", "--config", "examples/gsm8k_remax.yaml", f"cluster.fileroot={tmp_path}"]
    again = launch(args + CHEAP + overrides, 1200, server=running_server)
    (final,) = (tmp_path / "checkpoints" / "gsm8k-remax" / "trial0").glob("epoch*")  # the HF model of the last step
    line = f"[launcher] trial trial0 already finished (2 steps): nothing to start; final model: {final};"
    assert again.returncode == 0 and line in again.stdout, again.stdout[-3000:] + again.stderr[-2000:]
    assert "[launcher] trainer:" not in again.stdout and "[trainer]" not in again.stdout, again.stdout[-2000:]


@pytest.mark.slow
def test_ppo_critic_example_two_steps(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path, running_server: RunningServer
) -> None:
    overrides = [f"actor.engine.path={tiny_model_dir}", f"train_dataset.path={gsm8k_dir}"]
    # Staleness 0: synchronous rollout (async_training follows the bound); step 2 must see the new weights.
    stats = _launch("gsm8k_ppo", [*overrides, "rollout.max_head_offpolicyness=0"], tmp_path, server=running_server)
    actor_loss = stats["actor/ppo_actor/update/loss"]
    critic_loss = stats["critic/ppo_critic/loss"]
    assert len(actor_loss) == 2 and _finite(actor_loss)
    assert len(critic_loss) == 2 and _finite(critic_loss)
    # The critic fits real returns: a real optimizer step each time, with a non-zero gradient
    # (its fresh value head does not predict the returns yet).
    assert _finite(stats["critic/ppo_critic/value_error/avg"])
    assert stats["critic/ppo_critic/update_successful"] == [1.0, 1.0]
    assert all(g > 0 for g in stats["critic/ppo_critic/grad_norm"]), stats["critic/ppo_critic/grad_norm"]
    assert stats["actor/ppo_actor/update/update_successful"] == [1.0, 1.0]
    # Staleness 0: every batch is on-policy, so the server's logprobs replace the recompute forward.
    assert stats["actor/recompute_skipped"] == [1.0, 1.0] and "timeperf/actor/recompute_logp" not in stats
    assert len(stats["timeperf/compute_values"]) == len(stats["timeperf/critic/ppo_critic/fwd_bwd"]) == 2
    # Every token of step k's batch came from version k (the weights pushed after step k-1).
    assert stats["rollout_version_min"] == stats["rollout_version_max"] == [0.0, 1.0], stats["rollout_version_max"]


@pytest.mark.slow
def test_judge_rewarded_example_two_steps(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path, running_server: RunningServer
) -> None:
    """A second vLLM server (allocation_mode's vllm[judge]) scores every training sample; eval keeps GSM8K's reward.
    The policy runs on the session's server (``running_server``); the launcher starts the judge."""
    overrides = [f"actor.engine.path={tiny_model_dir}", f"aux_servers.judge.path={tiny_model_dir}"]
    # Staleness 0: step 2 is generated by the weights pushed after step 1 whatever the machine's load (with
    # the example's staleness 1, a loaded machine can generate all of step 2 before the push).
    overrides += [f"train_dataset.path={gsm8k_dir}", "rollout.max_head_offpolicyness=0"]
    stats = _launch("gsm8k_grpo", overrides, tmp_path, config="gsm8k_judge", server=running_server)
    assert stats["rollout/reward_service/failed"] == [0.0, 0.0] and stats["rollout/group_dropped"] == [0.0, 0.0]
    assert all(0.0 <= r <= 1.0 for r in stats["rollout/reward"])
    logs = tmp_path / "logs" / "gsm8k-judge" / "trial0"
    judged = (logs / "vllm-judge-server-0-requests.jsonl").read_text().splitlines()
    # every sample of both steps' 4 prompts x 4 samples was judged on the judge server, not the policy's
    assert len(judged) >= 2 * 4 * 4 and all('"/v1/chat/completions"' in line for line in judged)
    policy = running_server.requests()
    assert "/v1/chat/completions" not in policy and policy.count("/inference/v1/generate") >= 2 * 4, policy


def _launch_sync_without_eval(
    example: str, model: str, data: str, tmp_path: Path, server: RunningServer
) -> dict[str, list[float]]:
    """2 steps at staleness 0 (step 2 is generated by the weights pushed after step 1), no eval set, the policy on
    the running ``server``."""
    overrides = [f"actor.engine.path={model}", f"train_dataset.path={data}", "rollout.max_head_offpolicyness=0"]
    stats = _launch(example, overrides, tmp_path, with_eval=False, server=server)
    assert stats["actor/ppo_actor/update/update_successful"] == [1.0, 1.0]
    return stats


@pytest.mark.slow
def test_calculator_agent_example_two_steps(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path, running_server: RunningServer
) -> None:
    """The openai-client agent of examples/gsm8k_agent.py, through the proxy: 2 GRPO steps, each with a real
    optimizer step, on episodes that each made at least one chat.completions call. (The GRPO update's
    direction is asserted on fixed batches in test_ppo_actor.py; the tiny model earns no reward here.)"""
    stats = _launch_sync_without_eval("gsm8k_agent", tiny_model_dir, gsm8k_dir, tmp_path, running_server)
    # Every episode made at least one chat.completions call through the proxy, each one a trajectory.
    calls = stats["rollout/agent_calls"]
    assert len(calls) == 2 and all(c >= 1.0 for c in calls), calls
    assert all(c >= 1.0 for c in stats["rollout/agent_samples"]), stats["rollout/agent_samples"]


@pytest.mark.slow
def test_distillation_example_two_steps(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path, running_server: RunningServer
) -> None:
    """The launcher starts the larger tiny teacher (vllm[teacher]), which scores every sampled token; the
    student trains 2 steps on a finite, non-zero reverse KL. That each step descends the teacher-student
    gap is asserted on a fixed batch on every backend (test_distill_backends.py)."""
    stats = _launch_sync_without_eval("gsm8k_distill", tiny_model_dir, gsm8k_dir, tmp_path, running_server)
    kl = stats["actor/distill/reverse_kl/avg"]
    assert len(kl) == 2 and _finite(kl) and all(k != 0.0 for k in kl), kl
    # Every sampled token was scored on the teacher's server, none on the student's.
    logs = tmp_path / "logs" / "gsm8k-distill" / "trial0"
    scored = (logs / "vllm-teacher-server-0-requests.jsonl").read_text().splitlines()
    assert len(scored) >= 2 * 4 * 2, len(scored)  # 2 steps x 4 prompts x 2 samples

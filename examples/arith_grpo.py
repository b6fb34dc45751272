"""Learning check: GRPO from an SFT warm start on generated arithmetic word problems.

    python -m tandemrl.data.arith --out ./runs/data/arith
    python -m tandemrl.launchers.local examples/gsm8k_sft.py --config examples/arith_sft.yaml
    python -m tandemrl.launchers.local examples/arith_grpo.py --config examples/arith_grpo.yaml

Half of the SFT answers are bare (``#### 73``), half work the sum column by column, so the
warm-started model answers either way; the tiny model is right far more often when it works
the steps. GRPO, rewarded only for the final number, has to find that out. Measures greedy
accuracy on the held-out split before the first and after the last GRPO step, and prints
both with the elapsed time. The loop is the GSM8K one (tandemrl/trainers/rl_loop.py); the
reward is the GSM8K reward (the data is in its format).
"""

from __future__ import annotations

import time

import torch.distributed as dist

import tandemrl.data.arith  # noqa: F401  (registers the "arith" dataset name)
from tandemrl.algorithms.ppo import PPOActor
from tandemrl.configs import GRPOConfig
from tandemrl.rewards.gsm8k import gsm8k_reward_fn
from tandemrl.trainers.entry import load_config_or_exit
from tandemrl.trainers.rl_loop import RLTrainer, ppo_train_step
from tandemrl.utils.cli import run_main


def main(argv: list[str]) -> None:
    start = time.monotonic()
    config, _ = load_config_or_exit(argv, GRPOConfig)
    if config.valid_dataset is None:
        raise ValueError("valid_dataset: the learning check needs a held-out split to measure accuracy on")
    trainer = RLTrainer(config, name="grpo")
    actor = PPOActor(config.actor, trainer.actor_engine)
    ref = trainer.reference()
    workflow, eval_workflow = trainer.rlvr_workflows(gsm8k_reward_fn)
    before = trainer.evaluate(eval_workflow, 0)
    summary = trainer.run(workflow, ppo_train_step(actor, ref=ref), eval_workflow)
    after = trainer.evaluate(eval_workflow, summary.steps)
    if dist.get_rank() == 0:
        n = len(trainer.valid_dl.dataset) * trainer.actor_engine.data_parallel_world_size
        print(
            f"arith accuracy (greedy, {n} held-out problems): {before:.1%} before GRPO -> {after:.1%} after "
            f"{summary.steps} steps ({100 * (after - before):+.1f} points); GRPO {summary.seconds:.0f} s, "
            f"script {time.monotonic() - start:.0f} s",
            flush=True,
        )
    trainer.close()


if __name__ == "__main__":
    run_main(main)

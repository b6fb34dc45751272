"""GRPO on GSM8K: inference servers roll out while this SPMD script trains.

Started by the launcher, which brings up the servers named in allocation_mode:

    python -m tandemrl.launchers.local examples/gsm8k_grpo.py --config examples/gsm8k_grpo.yaml \
        train_dataset.path=../shared/data/gsm8k
"""

from __future__ import annotations

import dataclasses
import itertools

import torch.distributed as dist
from tqdm import tqdm

from tandemrl.actors.registry import engine_class
from tandemrl.configs import GRPOConfig
from tandemrl.configs.loader import load_config_or_exit, save_config
from tandemrl.data.loader import create_dataloader, dataset_from_config
from tandemrl.engines.types import FinetuneSpec
from tandemrl.inference.remote import remote_engine_for
from tandemrl.inference.types import WeightUpdateMeta
from tandemrl.models.hf import load_hf_tokenizer
from tandemrl.models.resolve import resolve_model_path
from tandemrl.rewards.gsm8k import gsm8k_reward_fn
from tandemrl.utils import stats_tracker
from tandemrl.utils.allocation import AllocationMode
from tandemrl.utils.cli import run_main
from tandemrl.utils.evaluator import Evaluator
from tandemrl.utils.saver import Saver
from tandemrl.utils.stats_logger import StatsLogger
from tandemrl.workflows.rlvr import RLVRWorkflow


def weight_update_meta(config: GRPOConfig, alloc: AllocationMode) -> WeightUpdateMeta:
    """Rank 0 picks the rendezvous address/port; every rank gets the same meta."""
    if config.weight_update_mode == "disk":
        meta = WeightUpdateMeta.from_disk(config.cluster.fileroot, config.experiment_name, config.trial_name)
    else:
        meta = WeightUpdateMeta.from_fsdp_collective(
            alloc, group_addr="127.0.0.1" if config.cluster.n_nodes == 1 else None
        )
    box = [meta]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main(argv: list[str]) -> None:
    config, _ = load_config_or_exit(argv, GRPOConfig)
    alloc = AllocationMode.from_str(config.allocation_mode)
    if alloc.train is None or alloc.gen is None:
        raise ValueError(f"allocation_mode: '{config.allocation_mode}' needs an inference and a training component")
    config.actor.path = resolve_model_path(config.actor.path, "actor.path", corpus_path=config.train_dataset.path)

    actor = engine_class("ppo_actor", alloc.train_backend)(config.actor)
    actor.create_process_group(alloc.train.strategy)
    rank, world = actor.data_parallel_rank, actor.data_parallel_world_size
    tokenizer = load_hf_tokenizer(config.tokenizer_path or config.actor.path)

    train_ds = dataset_from_config(config.train_dataset, tokenizer, rank, world)
    train_dl = create_dataloader(train_ds, config.train_dataset, rank, world, seed=config.seed)
    valid_dl = None
    if config.valid_dataset is not None:
        valid_ds = dataset_from_config(config.valid_dataset, tokenizer, rank, world)
        valid_dl = create_dataloader(valid_ds, config.valid_dataset, rank, world, seed=config.seed)
    ft_spec = FinetuneSpec(
        total_train_epochs=config.total_train_epochs,
        dataset_size=len(train_ds) * world,
        train_batch_size=config.train_dataset.batch_size,
        total_train_steps_override=config.total_train_steps,
    )
    actor.initialize(None, ft_spec)
    ref = None
    if config.actor.kl_ctl > 0 and config.ref is not None:
        config.ref.path = resolve_model_path(config.ref.path or config.actor.path, "ref.path")
        ref = engine_class("ppo_actor", alloc.train_backend)(config.ref)
        ref.create_process_group(alloc.train.strategy)
        ref.initialize(None, ft_spec)

    # Each trainer rank runs its own client; servers come from the launcher's environment.
    config.rollout.consumer_batch_size = config.train_dataset.batch_size // world
    rollout = remote_engine_for(alloc.gen_backend, config.rollout)
    rollout.initialize()
    eval_rollout = None
    if valid_dl is not None:
        # Evaluation is never throttled by staleness: it does not train on what it generates.
        eval_cfg = dataclasses.replace(config.rollout, max_head_offpolicyness=10**6)
        eval_rollout = remote_engine_for(alloc.gen_backend, eval_cfg)
        eval_rollout.initialize()
    meta = weight_update_meta(config, alloc)
    actor.connect_engine(rollout, meta)

    gconfig = config.gconfig.new(stop_token_ids=sorted({*config.gconfig.stop_token_ids, tokenizer.eos_token_id}))
    workflow = RLVRWorkflow(gsm8k_reward_fn, gconfig, tokenizer)
    eval_workflow = RLVRWorkflow(
        gsm8k_reward_fn, gconfig.new(greedy=True, n_samples=1), tokenizer, stat_scope="eval-rollout"
    )

    saver = Saver(config.saver, ft_spec)
    evaluator = Evaluator(config.evaluator, ft_spec)
    logger = StatsLogger(config.stats_logger, ft_spec)
    if dist.get_rank() == 0:
        save_config(config, f"{logger.log_dir}/config.yaml")

    def evaluate() -> None:
        for rows in valid_dl:
            eval_rollout.rollout_batch(rows, eval_workflow)

    group = config.actor.group_size
    data_iter = itertools.cycle(train_dl)
    total_steps = ft_spec.total_train_steps
    bar = tqdm(total=total_steps, desc="grpo", disable=dist.get_rank() != 0)
    for global_step in range(total_steps):
        epoch, step = divmod(global_step, ft_spec.steps_per_epoch)
        with stats_tracker.record_timing("rollout"):
            if config.async_training:
                batch = actor.prepare_batch(train_dl, workflow, granularity=group)
            else:
                batch = actor.rollout_batch(next(data_iter), workflow, granularity=group)
        with stats_tracker.record_timing("compute_logp"):
            if config.actor.recompute_logprob or config.actor.use_decoupled_loss:
                batch["prox_logp"] = actor.compute_logp(batch)
            if ref is not None:
                batch["ref_logp"] = ref.compute_logp(batch)
        with stats_tracker.record_timing("train_step"), stats_tracker.scope("actor"):
            actor.compute_advantages(batch)
            actor.ppo_update(batch)
            actor.step_lr_scheduler()
        with stats_tracker.record_timing("update_weights"):
            rollout.pause()
            actor.update_weights(meta.with_version(global_step + 1))
            actor.set_version(global_step + 1)
            rollout.set_version(global_step + 1)
            if eval_rollout is not None:
                eval_rollout.set_version(global_step + 1)
            rollout.resume()
        with stats_tracker.record_timing("save"):
            saver.save(actor, epoch, step, global_step, tokenizer=tokenizer)
        if valid_dl is not None:
            with stats_tracker.record_timing("eval"):
                evaluator.evaluate(evaluate, epoch, step, global_step)
        stats = [actor.export_stats(), rollout.export_stats()]
        if eval_rollout is not None:
            stats.append(eval_rollout.export_stats())
        logger.commit(epoch, step, global_step, stats)
        bar.update(1)
        reward = stats[1].get("rollout/reward")
        if reward is not None:
            bar.set_postfix(reward=f"{reward:.3f}")
    bar.close()
    logger.close()
    if dist.get_rank() == 0:
        root = saver.get_save_root(config.saver.fileroot, config.saver.experiment_name, config.saver.trial_name)
        print(f"grpo done: {total_steps} steps; logs in {logger.log_dir}; checkpoints under {root}", flush=True)
    rollout.destroy()
    if eval_rollout is not None:
        eval_rollout.destroy()
    actor.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)

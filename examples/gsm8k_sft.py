"""Supervised fine-tuning on GSM8K answers (loss on answer tokens only).

    torchrun --standalone --nproc_per_node=2 examples/gsm8k_sft.py --config examples/gsm8k_sft.yaml \
        train_dataset.path=../shared/data/gsm8k valid_dataset.path=../shared/data/gsm8k
"""

from __future__ import annotations

import torch.distributed as dist
from tqdm import tqdm

from tandemrl.algorithms.lm import LMEngine
from tandemrl.api.allocation import AllocationMode
from tandemrl.api.types import FinetuneSpec
from tandemrl.configs import SFTConfig
from tandemrl.configs.loader import save_config
from tandemrl.data.loader import create_dataloader, cycle_batches, dataset_from_config, pad_sequences_to_tensors
from tandemrl.engines.registry import make_engine
from tandemrl.engines.teardown import destroy_process_groups
from tandemrl.models.hf import load_hf_tokenizer, model_context_length
from tandemrl.models.resolve import resolve_model_path
from tandemrl.trainers.entry import load_config_or_exit
from tandemrl.trainers.evaluator import Evaluator
from tandemrl.trainers.recover import RecoverHandler
from tandemrl.trainers.saver import Saver, final_outputs_line
from tandemrl.trainers.stats_logger import StatsLogger
from tandemrl.utils import stats_tracker
from tandemrl.utils.cli import run_main


def main(argv: list[str]) -> None:
    config, _ = load_config_or_exit(argv, SFTConfig)
    alloc = AllocationMode.from_str(config.allocation_mode)
    if alloc.train is None:
        raise ValueError(f"allocation_mode: '{config.allocation_mode}' has no training component")
    config.model.path = resolve_model_path(config.model.path, "model.path", corpus_path=config.train_dataset.path)

    engine = make_engine(alloc.train_backend, config.model)  # the backend named in allocation_mode
    sft = LMEngine(engine)  # the algorithm, on that engine
    engine.create_process_group(alloc.train.strategy)
    rank, world = engine.data_parallel_rank, engine.data_parallel_world_size
    tokenizer = load_hf_tokenizer(config.tokenizer_path or config.model.path)

    context = model_context_length(config.model.path)
    train_ds = dataset_from_config(config.train_dataset, tokenizer, rank, world, context)
    train_dl = create_dataloader(train_ds, config.train_dataset, rank, world, seed=config.seed)
    valid_dl = None
    if config.valid_dataset is not None:
        valid_ds = dataset_from_config(config.valid_dataset, tokenizer, rank, world, context)
        valid_dl = create_dataloader(valid_ds, config.valid_dataset, rank, world, seed=config.seed)
    ft_spec = FinetuneSpec(
        total_train_epochs=config.total_train_epochs,
        dataset_size=len(train_ds) * world,
        train_batch_size=config.train_dataset.batch_size,
        total_train_steps_override=config.total_train_steps,
    )
    engine.initialize(None, ft_spec)

    saver = Saver(config.saver, ft_spec)
    evaluator = Evaluator(config.evaluator, ft_spec)
    logger = StatsLogger(config.stats_logger, ft_spec)
    if dist.get_rank() == 0:
        save_config(config, f"{logger.log_dir}/config.yaml")
    pad_id = tokenizer.pad_token_id

    def evaluate() -> None:
        total, n = 0.0, 0
        for rows in valid_dl:
            total += sft.evaluate_lm(pad_sequences_to_tensors(rows, pad_id))
            n += 1
        stats_tracker.scalar(eval_loss=total / max(n, 1))

    # recover.mode=auto|resume: continue after the last recoverable checkpoint (weights, optimizer,
    # LR schedule, dataloader position, saver/evaluator counters); see tandemrl.trainers.recover.
    recover = RecoverHandler(config.recover, ft_spec)
    state = recover.load({"model": engine}, engine, train_dl, saver, evaluator)
    first_step = 0 if state is None else state.global_step + 1
    batches = cycle_batches(train_dl, "train_dataset")
    total_steps = ft_spec.total_train_steps
    bar = tqdm(total=total_steps, initial=first_step, desc="sft", disable=dist.get_rank() != 0)
    for global_step in range(first_step, total_steps):
        epoch, step = divmod(global_step, ft_spec.steps_per_epoch)
        batch = pad_sequences_to_tensors(next(batches), pad_id)
        with stats_tracker.record_timing("train_step"):
            stats = sft.train_lm(batch)
        with stats_tracker.record_timing("save"):
            saver.save(engine, epoch, step, global_step, tokenizer=tokenizer, last=global_step == total_steps - 1)
        if valid_dl is not None:
            with stats_tracker.record_timing("eval"):
                evaluator.evaluate(evaluate, epoch, step, global_step)
        logger.commit(epoch, step, global_step, engine.export_stats())
        last = global_step == total_steps - 1
        recover.dump({"model": engine}, engine, train_dl, step, global_step, saver, evaluator, last=last)
        bar.update(1)
        bar.set_postfix(loss=f"{stats['loss']:.4f}")
    bar.close()
    logger.close()
    if dist.get_rank() == 0:
        print(
            f"sft done: {total_steps - first_step} steps; logs in {logger.log_dir}; checkpoints under {saver.get_save_root(config.saver.fileroot, config.saver.experiment_name, config.saver.trial_name)}"
        )
        print(final_outputs_line("sft", saver.last_path, recover), flush=True)
    engine.destroy()
    destroy_process_groups()


if __name__ == "__main__":
    run_main(main)

"""Held-out greedy accuracy before the first step and after the last, through the run's own servers.

Global rank 0 scores the first ``heldout_eval.n`` rows of the held-out split with
``tandemrl.workflows.gsm8k_eval.evaluate_gsm8k`` (the library behind ``python -m tandemrl.eval``),
writes ``heldout_<tag>.json`` next to the logs and prints one line; other ranks wait at a barrier.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from tandemrl.configs.utils import HeldoutEvalConfig
from tandemrl.utils.files import names_file

if TYPE_CHECKING:
    from tandemrl.api.workflow import GenerationClient
    from tandemrl.workflows.gsm8k_eval import EvalResult


@dataclass
class HeldoutScore:
    """One scoring of the held-out slice: its tag (before/after), the weight version and the result."""

    tag: str
    version: int
    result: EvalResult

    def line(self) -> str:
        r = self.result
        return f"{r.accuracy:.3f} ({r.correct}/{r.n}) [{r.interval_low:.3f}, {r.interval_high:.3f}]"


class HeldoutEval:
    """Scores the held-out slice on demand; a no-op when ``n`` is 0."""

    def __init__(self, config: HeldoutEvalConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.scores: list[HeldoutScore] = []
        self._rows: list[dict[str, Any]] = []
        if config.n > 0 and _is_rank0():
            self._rows = _load_rows(config, tokenizer)

    @property
    def enabled(self) -> bool:
        return self.config.n > 0

    @property
    def log_dir(self) -> str:
        c = self.config
        return os.path.join(c.fileroot, "logs", c.experiment_name, c.trial_name)

    def score(self, client: GenerationClient, tag: str, version: int) -> HeldoutScore | None:
        """Score the slice on ``client`` (rank 0), write ``heldout_<tag>.json`` and print a line."""
        if not self.enabled:
            return None
        out = None
        if _is_rank0():
            from tandemrl.workflows.gsm8k_eval import evaluate_gsm8k

            result = evaluate_gsm8k(client, self.tokenizer, self._rows, self.config.max_new_tokens)
            out = HeldoutScore(tag, version, result)
            self.scores.append(out)
            path = self._write(out)
            tasks = f" (by task: {result.tasks_line()})" if result.by_task() else ""
            print(
                f"held-out greedy accuracy {tag} training (version {version}): {out.line()}{tasks}; {path}", flush=True
            )
        if dist.is_initialized():
            dist.barrier()
        return out

    def report(self) -> str | None:
        """``before -> after`` with both intervals, or None until both were scored."""
        by_tag = {s.tag: s for s in self.scores}
        if "before" not in by_tag or "after" not in by_tag:
            return None
        c = self.config
        from tandemrl.workflows.gsm8k_eval import paired_change

        change = paired_change(by_tag["before"].result, by_tag["after"].result)
        return (
            f"held-out greedy accuracy on {c.split}[:{c.n}] ({os.path.basename(os.path.normpath(c.path))}): "
            f"{by_tag['before'].line()} -> {by_tag['after'].line()} (95% Wilson score intervals); {change.line()}"
        )

    def _write(self, score: HeldoutScore) -> str:
        os.makedirs(self.log_dir, exist_ok=True)
        path = os.path.join(self.log_dir, f"heldout_{score.tag}.json")
        report = {
            "tag": score.tag,
            "version": score.version,
            "data": os.path.abspath(self.config.path),
            "split": self.config.split,
            "prompt_format": "chat_template" if score.result.chat_template else "plain_question",
            **score.result.to_dict(),
        }
        with names_file(f"{path}.tmp"), open(f"{path}.tmp", "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1, ensure_ascii=False)
            f.write("\n")
        os.replace(f"{path}.tmp", path)
        return path


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _load_rows(config: HeldoutEvalConfig, tokenizer: Any) -> list[dict[str, Any]]:
    from tandemrl.configs.data import DatasetConfig
    from tandemrl.data.gsm8k import get_gsm8k_rl_dataset
    from tandemrl.data.loader import check_dataset_inputs

    available = check_dataset_inputs(
        DatasetConfig(path=config.path, type="rl", split=config.split, max_samples=config.n)
    )
    if available is not None and available < config.n:
        raise ValueError(
            f"heldout_eval.n: {config.n}, but split {config.split!r} of {config.path} has {available} rows"
        )
    ds = get_gsm8k_rl_dataset(config.path, config.split, tokenizer, rank=0, world_size=1, max_samples=config.n)
    return ds.to_list()

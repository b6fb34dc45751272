"""GRPO on GSM8K prompts (examples/gsm8k_grpo.py) whose rollouts leave the sample ledger every way a
run can: the reward fails on prompts whose id is 0 mod 5 (the workflow drops the group), is the same
for every sample of prompts whose id is 1 mod 5 (dynamic sampling filters the group), and otherwise
differs between the samples (grpo_dense_reward's share of digits plus a tiny random term). Run it with
``actor.dynamic_sampling=true`` and ``actor.mask_no_eos=true``, so truncated samples are ``too_long``.
Run through the launcher like the example.
"""

from __future__ import annotations

import random
from typing import Any

from grpo_dense_reward import digit_share, run_grpo  # this script's directory is on sys.path

from tandemrl.utils.cli import run_main

FAILS, UNIFORM = 0, 1  # prompt id mod 5


def reward(completions: str, id: int, **_: Any) -> float:  # noqa: A002 (the dataset's column)
    if id % 5 == FAILS:
        raise RuntimeError(f"no reward for prompt {id}")
    if id % 5 == UNIFORM:
        return 0.5
    return digit_share(completions) + 1e-3 * random.random()


if __name__ == "__main__":
    run_main(lambda argv: run_grpo(argv, reward))

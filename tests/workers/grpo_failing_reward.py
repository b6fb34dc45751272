"""The GRPO example with a reward function that always raises (the failure-budget test's run)."""

from __future__ import annotations

from typing import Any

from grpo_dense_reward import run_grpo

from tandemrl.utils.cli import run_main


def always_fails(completions: str, **_: Any) -> float:
    return len(completions) / 0


def main(argv: list[str]) -> None:
    run_grpo(argv, always_fails)


if __name__ == "__main__":
    run_main(main)

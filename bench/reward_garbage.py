"""Seconds gsm8k_reward_fn spends on pathological completions (towers of powers, huge factorials,
200k characters): the speed the tests do not assert. Prints one line per completion, never asserts.

    python bench/reward_garbage.py
"""

from __future__ import annotations

import time

from tandemrl.rewards.gsm8k import gsm8k_reward_fn

COMPLETIONS = {
    "power tower": "9**9**9**9",
    "boxed power tower": "\\boxed{9^{9^{9^{9}}}}",
    "boxed factorial": "\\boxed{100000!}",
    "boxed binomial": "\\boxed{\\binom{100000}{50000}}",
    "6000 nines": "9" * 6000,
    "200k letters": "x" * 200000,
    "a right answer": "So the answer is \\boxed{72}.",
}


def main() -> None:
    gsm8k_reward_fn("p", "#### 1", None, None, answer="#### 1")  # math-verify's lazy imports
    for name, completion in COMPLETIONS.items():
        start = time.perf_counter()
        value = gsm8k_reward_fn("p", completion, None, None, answer="#### 72")
        print(f"{name:>18}: reward {value:.0f} in {1000 * (time.perf_counter() - start):8.2f} ms")


if __name__ == "__main__":
    main()

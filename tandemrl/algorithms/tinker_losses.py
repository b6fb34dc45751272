"""The built-in losses of the Tinker API as pure tensor functions (``tandemrl tinker-serve``, docs/tinker.md).

Each takes one datum's per-token ``logp`` (the trained policy's log-probability of each target
token, with grad) and that datum's ``loss_fn_inputs`` tensors of the same length, and returns the
per-token loss. The datum's loss is the sum over its tokens and the batch's loss the sum over
its datums: Tinker sums, the caller decides any normalisation through ``weights``/``advantages``.

- ``cross_entropy``: ``-weights * logp``.
- ``importance_sampling``: ``-exp(logp - logprobs) * advantages`` (``logprobs``: the sampler's).
- ``ppo``: ``-min(r * A, clip(r, low, high) * A)`` with ``r = exp(logp - logprobs)``;
  ``clip_low_threshold`` / ``clip_high_threshold`` (config, default 0.8 / 1.2) bound the ratio.
- ``cispo``: ``-sg(clip(r, low, high)) * logp * A``: the clipped ratio weights a REINFORCE term.
- ``dro``: ``-(logp * A - beta / 2 * (logp - logprobs)^2)`` with ``beta`` (config, default 0.05).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

Inputs = Mapping[str, torch.Tensor]
Config = Mapping[str, float]


def _ratio(logp: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    return torch.exp(logp - inputs["logprobs"])


def _bounds(config: Config) -> tuple[float, float]:
    low, high = float(config.get("clip_low_threshold", 0.8)), float(config.get("clip_high_threshold", 1.2))
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(f"loss_fn_config: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {low}, {high}")
    return low, high


def cross_entropy(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    return -inputs["weights"] * logp


def importance_sampling(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    return -_ratio(logp, inputs) * inputs["advantages"]


def ppo(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    low, high = _bounds(config)
    ratio, adv = _ratio(logp, inputs), inputs["advantages"]
    return -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)


def cispo(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    low, high = _bounds(config)
    return -_ratio(logp, inputs).clamp(low, high).detach() * logp * inputs["advantages"]


def dro(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    beta = float(config.get("beta", 0.05))
    return -(logp * inputs["advantages"] - 0.5 * beta * (logp - inputs["logprobs"]) ** 2)


LossFn = Callable[[torch.Tensor, Inputs, Config], torch.Tensor]
# name -> (function, the loss_fn_inputs it needs besides target_tokens)
LOSSES: dict[str, tuple[LossFn, tuple[str, ...]]] = {
    "cross_entropy": (cross_entropy, ("weights",)),
    "importance_sampling": (importance_sampling, ("advantages", "logprobs")),
    "ppo": (ppo, ("advantages", "logprobs")),
    "cispo": (cispo, ("advantages", "logprobs")),
    "dro": (dro, ("advantages", "logprobs")),
}


def loss_inputs_needed(name: str) -> tuple[str, ...]:
    """The ``loss_fn_inputs`` (besides ``target_tokens``) loss ``name`` reads; one-line error for an unknown name."""
    if name not in LOSSES:
        raise ValueError(f"loss_fn: unknown loss {name!r} (one of: {', '.join(LOSSES)})")
    return LOSSES[name][1]


def tinker_loss(name: str, logp: torch.Tensor, inputs: Inputs, config: Config | None = None) -> torch.Tensor:
    """Per-token loss of loss ``name`` for one datum (sum it for the datum's loss)."""
    loss_inputs_needed(name)
    return LOSSES[name][0](logp, inputs, config or {})

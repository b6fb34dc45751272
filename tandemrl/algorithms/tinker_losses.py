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
- ``gspo``: ppo's clipped term with one ratio per datum, ``s = exp(mean(logp - logprobs))`` over the
  positions of ``sequence_ratio_mask`` (an optional input; without it, the positions whose advantage
  is not 0), in the per-token form of the GSPO paper (arXiv 2507.18071): token t uses
  ``s_t = sg(s) * exp(logp_t - sg(logp_t))``, equal to ``s`` in value, its gradient through its own
  ``logp_t`` only. Same thresholds and defaults as ``ppo``.

Refused (``REFUSED``, one line each): ``stable_reinforce`` and ``custom``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

Inputs = Mapping[str, torch.Tensor]
Config = Mapping[str, float]
CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")


def _ratio(logp: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    return torch.exp(logp - inputs["logprobs"])


def _bounds(config: Config) -> tuple[float, float]:
    low, high = float(config.get("clip_low_threshold", 0.8)), float(config.get("clip_high_threshold", 1.2))
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(f"loss_fn_config: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {low}, {high}")
    return low, high


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, config: Config) -> torch.Tensor:
    low, high = _bounds(config)
    return -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)


def cross_entropy(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    return -inputs["weights"] * logp


def importance_sampling(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    return -_ratio(logp, inputs) * inputs["advantages"]


def ppo(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    return _clipped(_ratio(logp, inputs), inputs["advantages"], config)


def cispo(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    low, high = _bounds(config)
    return -_ratio(logp, inputs).clamp(low, high).detach() * logp * inputs["advantages"]


def dro(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    beta = float(config.get("beta", 0.05))
    return -(logp * inputs["advantages"] - 0.5 * beta * (logp - inputs["logprobs"]) ** 2)


def sequence_ratio_mask(inputs: Inputs) -> torch.Tensor:
    """gspo's mask: the datum's ``sequence_ratio_mask``, else 1 where the advantage is not 0."""
    if "sequence_ratio_mask" in inputs:
        return inputs["sequence_ratio_mask"]
    return (inputs["advantages"] != 0).to(inputs["advantages"].dtype)


def gspo(logp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    mask = sequence_ratio_mask(inputs)
    log_s = ((logp - inputs["logprobs"]) * mask).sum() / mask.sum().clamp(min=1.0)
    ratio = torch.exp(logp - logp.detach() + log_s.detach())
    return _clipped(ratio, inputs["advantages"], config)


LossFn = Callable[[torch.Tensor, Inputs, Config], torch.Tensor]


@dataclass(frozen=True)
class LossSpec:
    """A served loss: its function, the ``loss_fn_inputs`` it needs besides ``target_tokens``, the ones it
    reads when present, and the ``loss_fn_config`` keys it takes."""

    fn: LossFn
    inputs: tuple[str, ...]
    config: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()


RL_INPUTS = ("advantages", "logprobs")
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("weights",)),
    "importance_sampling": LossSpec(importance_sampling, RL_INPUTS),
    "ppo": LossSpec(ppo, RL_INPUTS, CLIP_KEYS),
    "cispo": LossSpec(cispo, RL_INPUTS, CLIP_KEYS),
    "dro": LossSpec(dro, RL_INPUTS, ("beta",)),
    "gspo": LossSpec(gspo, RL_INPUTS, CLIP_KEYS, ("sequence_ratio_mask",)),
}
# Loss names the SDK 0.38 sends that are not served, with the reason (the error's one line).
REFUSED: dict[str, str] = {
    "stable_reinforce": "Tinker does not publish its objective (it reads stability records that Tinker's own "
    "sampler keeps for record_stability_info); use ppo, cispo or gspo",
    "custom": "it runs a loss uploaded with create_custom_loss, which tinker-serve does not store "
    "(custom_loss_server_side is off, so forward_backward_custom computes the loss in the client)",
}


def loss_spec(name: str) -> LossSpec:
    """The spec of loss ``name``; a one-line ValueError for a refused or unknown name."""
    if name in REFUSED:
        raise ValueError(f"loss_fn: {name!r} is not served by tinker-serve: {REFUSED[name]}")
    if name not in LOSSES:
        raise ValueError(f"loss_fn: unknown loss {name!r} (one of: {', '.join(LOSSES)})")
    return LOSSES[name]


def loss_inputs_needed(name: str) -> tuple[str, ...]:
    """The ``loss_fn_inputs`` (besides ``target_tokens``) loss ``name`` needs; one-line error for an unknown name."""
    return loss_spec(name).inputs


def check_config(name: str, keys: list[str]) -> None:
    """One-line ValueError naming the first ``loss_fn_config`` key that loss ``name`` does not take."""
    takes = loss_spec(name).config
    for key in keys:
        if key not in takes:
            what = f"it takes: {', '.join(takes)}" if takes else "it takes none"
            raise ValueError(f"loss_fn_config: unknown key {key!r} for loss {name!r} ({what})")


def with_defaults(name: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``inputs`` with loss ``name``'s optional inputs filled in where absent (gspo: its default mask), so every
    datum of a batch carries the same keys."""
    if "sequence_ratio_mask" in loss_spec(name).optional and "sequence_ratio_mask" not in inputs:
        inputs["sequence_ratio_mask"] = sequence_ratio_mask(inputs)
    return inputs


def tinker_loss(name: str, logp: torch.Tensor, inputs: Inputs, config: Config | None = None) -> torch.Tensor:
    """Per-token loss of loss ``name`` for one datum (sum it for the datum's loss)."""
    return loss_spec(name).fn(logp, inputs, config or {})

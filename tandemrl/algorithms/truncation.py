"""Trainer-side replay of truncated sampling (min-p, top-k, top-p), so importance ratios compare like with like.

vLLM samples each token from ``logits / T``, then drops tokens by min-p, top-k and top-p (in that order)
and renormalises over the kept set; with ``logprobs_mode=processed_logprobs`` (the default our vLLM
launch sets, :meth:`tandemrl.inference.vllm.VLLMBackend.server_command`) the logprob it returns is of
that renormalised distribution. A full-vocabulary logprob is lower by ``log(mass of the kept set)``
on every token, so without the replay every ratio ``exp(trainer - server)`` is biased below 1.

The kept set follows vLLM's PyTorch sampler (``vllm/v1/sample/ops/topk_topp_sampler.py`` and the
built-in min-p logits processor), in fp32 on ``logits / T``:

* min-p: drop tokens whose probability is below ``min_p`` times the largest probability;
* top-k: drop tokens whose logit is below the k-th largest; every token tied with it stays;
* top-p: softmax over what top-k left, sorted ascending (equal logits in token-id order), drop each
  token whose cumulative probability up to and including itself is ``<= 1 - top_p``; the most
  probable token always stays. So the kept set is the smallest top set whose mass reaches top_p.

vLLM's Triton kernel (CUDA builds) keeps exactly k tokens when several tie with the k-th, and its
unstable sort may order equal logits otherwise; exact float ties at a boundary are the only place
the replay can then differ.

A sampled token the trainer's replay does not keep (only possible when its logits differ from the
sampler's: numerics, or weights that moved since sampling) is scored over the kept set plus itself:
finite, with a gradient that can bring it back, and equal to the in-set value at the boundary. Such
tokens are counted (``truncation_outside_frac``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandemrl.configs.ppo import PPOActorConfig
from tandemrl.models.functional import gather_logprobs, gather_logprobs_entropy

# Rows of [rows, vocab] sorted at once when building the kept set: bounds the sort's extra memory.
_CHUNK_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class Truncation:
    """The sampler's truncation: ``top_k <= 0``, ``top_p >= 1`` and ``min_p <= 0`` each disable one filter."""

    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def replay_of(config: PPOActorConfig) -> Truncation | None:
    """The truncation to replay: None unless ``truncation_replay`` is on and some filter is set."""
    if not config.truncation_replay:
        return None
    replay = Truncation(config.top_k, config.top_p, config.min_p)
    return replay if replay.active else None


def _kept_rows(z: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    z = z.clone()
    neg_inf = float("-inf")
    if min_p > 0.0:
        probs = z.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, dtype=z.dtype, device=z.device)
        z.masked_fill_(probs < floor, neg_inf)
    vocab = z.shape[-1]
    k = top_k if 0 < top_k < vocab else 0
    if top_p >= 1.0:
        if k:
            z.masked_fill_(z < z.topk(k, dim=-1).values[:, -1:], neg_inf)
        return z != neg_inf
    s, order = z.sort(dim=-1, stable=True)
    if k:
        s.masked_fill_(s < s[:, vocab - k : vocab - k + 1], neg_inf)
    cumulative = s.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - torch.tensor(top_p, dtype=z.dtype, device=z.device)
    drop[:, -1] = False
    s.masked_fill_(drop, neg_inf)
    return z.scatter(-1, order, s) != neg_inf


@torch.no_grad()
def kept_mask(scaled: torch.Tensor, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """[N, V] bool: the tokens the sampler keeps from the temperature-scaled logits ``scaled`` [N, V]."""
    scaled = scaled.float()
    rows = max(1, _CHUNK_ELEMENTS // max(1, scaled.shape[-1]))
    if scaled.shape[0] <= rows:
        return _kept_rows(scaled, top_k, top_p, min_p)
    return torch.cat([_kept_rows(c, top_k, top_p, min_p) for c in torch.split(scaled, rows)])


def truncated_logprobs(
    logits: torch.Tensor,
    next_tokens: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp [N], outside [N] bool): log-probability of each next token under the truncated sampling
    distribution of ``logits`` [N, V] (fp32), and whether the token fell outside the kept set
    (then scored over the kept set plus itself). Differentiable in ``logits``; the set is not."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    labels = next_tokens.long().unsqueeze(-1)
    keep = kept_mask(z.detach(), top_k, top_p, min_p)
    outside = ~keep.gather(-1, labels).squeeze(-1)
    keep.scatter_(-1, labels, True)
    logp = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1).gather(-1, labels).squeeze(-1)
    return logp, outside


def policy_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    replay: Truncation | None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(logp, entropy or None, outside or None): the trainer's logprobs of ``labels`` at ``temperature``,
    over the full vocabulary when ``replay`` is None, else under the replayed truncation. The entropy is
    always of the full temperature-scaled distribution (what ``entropy_coeff`` regularises)."""
    if replay is None:
        if with_entropy:
            full_logp, full_entropy = gather_logprobs_entropy(logits, labels, temperature)
            return full_logp, full_entropy, None
        return gather_logprobs(logits, labels, temperature), None, None
    logp, outside = truncated_logprobs(logits, labels, temperature, replay.top_k, replay.top_p, replay.min_p)
    entropy = gather_logprobs_entropy(logits, labels, temperature)[1] if with_entropy else None
    return logp, entropy, outside

"""Configs of the rollout side: sampling parameters and the inference client."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandemrl.api.generation import GenerationHyperparameters
from tandemrl.api.renamed import retired_names


@dataclass
class InferenceClientConfig:
    """The client of remote inference servers and the rollout executor that drives it."""

    experiment_name: str = field(default="${experiment_name}", metadata={"help": "Filled from the root config."})
    trial_name: str = field(default="${trial_name}", metadata={"help": "Filled from the root config."})
    max_concurrent_rollouts: int | None = field(
        default=None,
        metadata={
            "help": "Episodes running at once per data-parallel rank; None means all the staleness bound allows: "
            "(max_head_offpolicyness + 1) x the per-rank batch (one batch when synchronous). --dry-run prints it.",
            "min": 1,
        },
    )
    queue_size: int | None = field(
        default=None, metadata={"help": "Input/output queue size; None picks a default.", "min": 1}
    )
    max_head_offpolicyness: int = field(
        default=0, metadata={"help": "Max versions a sample may lag the trainer; 0 is synchronous RL.", "min": 0}
    )
    enable_rollout_tracing: bool = field(default=False, metadata={"help": "Log each rollout's lifecycle."})
    stats_name: str = field(
        default="rollout", metadata={"help": "Stats tracker (and key prefix) of this client's rollout statistics."}
    )
    workflow_error_policy: str = field(
        default="raise",
        metadata={
            "help": "A workflow exception: 'raise' re-raises it in the trainer's next wait(); 'drop' counts and skips it.",
            "choices": ["raise", "drop"],
        },
    )
    pause_mode: str = field(
        default="abort",
        metadata={
            "help": "What a weight update does with requests in flight: 'abort' returns their partial output and "
            "the client resubmits it on the new weights (the prefix is re-prefilled); 'keep' holds them inside the "
            "server, which continues them on the new weights over the KV they already have (vLLM only; "
            "see docs/offpolicy.md).",
            "choices": ["abort", "keep"],
        },
    )
    max_consecutive_drops: int = field(
        default=50,
        metadata={
            "help": "Stop the run (one line naming the most common cause) when this many groups in a row were "
            "dropped by failures: a reward that raised, timed out or returned junk, a workflow error under "
            "'drop'. Filtered groups (should_accept_fn) do not count. 0 turns this check off.",
            "min": 0,
        },
    )
    max_dropped_share: float = field(
        default=0.5,
        metadata={
            "help": "Stop the run when more than this share of the last drop_window finished groups were dropped "
            "by failures; 1.0 turns this check off, 0.0 stops at the first dropped group once drop_window groups "
            "finished.",
            "min": 0.0,
            "max": 1.0,
        },
    )
    drop_window: int = field(
        default=200, metadata={"help": "Finished groups max_dropped_share looks back over.", "min": 1}
    )
    request_timeout: float = field(default=3600.0, metadata={"help": "Seconds before a generation request fails."})
    request_retries: int = field(default=3, metadata={"help": "Retries (with failover) per request.", "min": 0})
    request_backoff: float = field(
        default=0.5, metadata={"help": "Seconds before a request's first retry; doubles on each further retry."}
    )
    setup_timeout: float = field(
        default=600.0,
        metadata={
            "help": "Seconds to wait for servers to become healthy: the launcher's wait for the servers it "
            "starts (a cold start loads the model), and the client's in initialize()."
        },
    )
    server_addrs: list[str] = field(
        default_factory=list,
        metadata={
            "help": "host:port of running servers: the local launcher starts none and the RL trainer pushes its "
            "initial weights to them (version 0) before the first rollout; empty: the launcher's servers."
        },
    )

    def concurrency(self, per_rank_batch: int) -> int:
        """Episodes one rank keeps running: ``max_concurrent_rollouts``, else all the staleness bound lets start,
        ``(max_head_offpolicyness + 1) x per_rank_batch``, so the next batches are under way while the trainer
        trains (synchronous: one batch)."""
        if self.max_concurrent_rollouts is not None:
            return self.max_concurrent_rollouts
        return (self.max_head_offpolicyness + 1) * per_rank_batch


__all__ = ["GenerationHyperparameters", "InferenceClientConfig"]

if not TYPE_CHECKING:  # old names fail with the line naming the new one (tandemrl.api.renamed)
    __getattr__ = retired_names(__name__)

"""Configs of the PPO-family actor (GRPO, DAPO, RLOO, ... are presets of it) and of the PPO critic.

Each holds its algorithm fields plus ``engine``: the model it trains and how (a
:class:`TrainEngineConfig`, YAML ``actor.engine.*``); the algorithm never inherits the engine's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandemrl.configs.engine import TrainEngineConfig

_LEVELS = ["batch", "group", "none"]


@dataclass
class NormConfig:
    """Advantage baseline and scaling: ``A = (A - baseline) / (std + eps)``.

    Statistics pool over the row's group (``group_size`` samples of one prompt), the whole
    batch (across all data-parallel ranks), or nothing.
    """

    mean_level: str = field(
        default="batch", metadata={"help": "Baseline: mean over the batch, the group, or none.", "choices": _LEVELS}
    )
    std_level: str = field(
        default="batch", metadata={"help": "Scale: std over the batch, the group, or none.", "choices": _LEVELS}
    )
    leave_one_out: bool = field(
        default=False, metadata={"help": "Baseline excludes the sample itself (RLOO: mean of the others)."}
    )
    std_unbiased: bool = field(default=True, metadata={"help": "Divide the variance by n - 1 instead of n."})
    eps: float = field(default=1e-5, metadata={"help": "Added to the std."})
    unit: str = field(
        default="token",
        metadata={
            "help": "Statistics over one value per sequence (its return at the first generated token; "
            "GRPO/RLOO as in the papers) or over every generated token (REINFORCE++, PPO whitening).",
            "choices": ["sequence", "token"],
        },
    )


@dataclass
class PPOActorConfig:
    """A policy trained with a PPO-style objective; algorithms are choices of these fields.

    The defaults (``adv_norm`` over every token of the batch) are REINFORCE++/PPO-style
    whitening, not GRPO: a GRPO config sets the GRPO row (``preset:grpo_gsm8k`` does).

    ============  ==============================================================================
    Algorithm     Fields (others at their defaults)
    ============  ==============================================================================
    GRPO          adv_norm: {mean_level: group, std_level: group, unit: sequence};
                  group_size: n_samples; optional kl_ctl>0 + use_kl_loss + kl_estimator: k3;
                  loss_agg_mode token-mean (the default, as DAPO); the paper's per-sequence
                  mean is loss_agg_mode: seq-mean-token-mean
    Dr.GRPO       adv_norm: {mean_level: group, std_level: none, unit: sequence};
                  loss_agg_mode: seq-mean-token-sum, loss_agg_norm_len: <max_new_tokens>
                  (the paper's constant normalizer; token-mean is the other unbiased choice)
    DAPO          GRPO's adv_norm; eps_clip: 0.2, eps_clip_higher: 0.28; loss_agg_mode: token-mean;
                  overlong_buffer: e.g. 256, overlong_penalty_factor: 1.0, max_new_tokens: <gen len>;
                  dynamic_sampling: true (should_accept_fn=reject_uniform_rewards)
    RLOO          adv_norm: {mean_level: group, std_level: none, leave_one_out: true, unit: sequence}
    REINFORCE++   adv_norm: {mean_level: batch, std_level: batch, unit: token};
                  kl_ctl > 0 with a reference model (KL as per-token reward, kl_estimator: k1
                  as in the paper)
    GSPO          GRPO's adv_norm; importance_sampling_level: sequence; eps_clip: 3e-4,
                  eps_clip_higher: 4e-4; loss_agg_mode: seq-mean-token-mean
    PPO (critic)  critic: PPOCriticConfig (its engine has is_critic: true); batch['values'] from
                  PPOCritic.compute_values; discount/gae_lambda for GAE;
                  adv_norm: {mean_level: batch, std_level: batch, unit: token}
    ReMax         ReMaxRLVRWorkflow rewards (sample - greedy); adv_norm: {mean_level: none,
                  std_level: none} (or ReinforceActor.train_reinforce: temperature, truncation
                  replay and offpolicy_correction apply to it too)
    ============  ==============================================================================

    Off-policy (asynchronous) samples and the trainer/server numerical gap: offpolicy_correction
    (default auto: token TIS, or use_decoupled_loss + behav_imp_weight_cap's capped weights);
    recompute_logprob 'auto' (default) recomputes the proximal logprobs only when needed.
    """

    engine: TrainEngineConfig = field(
        default_factory=TrainEngineConfig, metadata={"help": "The policy model and how it is trained."}
    )
    group_size: int = field(default=1, metadata={"help": "Samples per prompt (GRPO group).", "min": 1})
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO dynamic sampling: drop groups whose rewards are all equal (they train nothing) and "
            "roll out more prompts until the batch is full. Needs group_size > 1."
        },
    )
    dynamic_sampling_rounds: int = field(
        default=8,
        metadata={
            "help": "Dynamic sampling: how many batches' worth of new prompts a step may draw (sync) or take "
            "from the dataloader while no batch fills (async) to replace dropped groups before it fails with a "
            "line saying so.",
            "min": 1,
        },
    )
    ppo_n_minibatches: int = field(default=1, metadata={"help": "Minibatches per PPO epoch.", "min": 1})
    ppo_n_epochs: int = field(default=1, metadata={"help": "Passes over each batch.", "min": 1})
    eps_clip: float = field(default=0.2, metadata={"help": "Lower (and default upper) ratio clip.", "gt": 0.0})
    eps_clip_higher: float | None = field(
        default=None, metadata={"help": "Upper ratio clip (DAPO clip-higher).", "gt": 0.0}
    )
    c_clip: float | None = field(
        default=None, metadata={"help": "Dual-clip bound (> 1) for negative advantages.", "gt": 1.0}
    )
    temperature: float = field(
        default=1.0, metadata={"help": "Logits are divided by this (match the sampler).", "gt": 0.0}
    )
    kl_ctl: float = field(default=0.0, metadata={"help": "KL coefficient against the reference policy."})
    reward_scaling: float = field(default=1.0, metadata={"help": "Multiply rewards."})
    reward_bias: float = field(default=0.0, metadata={"help": "Add to rewards."})
    reward_clip: float = field(default=20.0, metadata={"help": "Clip rewards to [-x, x]."})
    discount: float = field(default=1.0, metadata={"help": "GAE gamma."})
    gae_lambda: float = field(default=1.0, metadata={"help": "GAE lambda."})
    recompute_logprob: str = field(
        default="auto",
        metadata={
            "help": "Proximal (pre-update) logprobs, read by a correction over several optimizer steps and by a "
            "KL reward: 'auto' recomputes them (one extra forward) when the update takes several steps with a "
            "correction on, or a KL reward is on and some generated token came from older weights than the "
            "trainer's; 'always' every step; 'never' uses the server's (behaviour) logprobs. With "
            "offpolicy_correction none the PPO ratio is always taken against the behaviour logprobs.",
            "choices": ["auto", "always", "never"],
        },
    )
    use_decoupled_loss: bool = field(
        default=False,
        metadata={
            "help": "Decoupled PPO with behaviour weights exp(prox - behav) (needs recompute_logprob != never); "
            "the legacy form of offpolicy_correction, read only when that is auto."
        },
    )
    behav_imp_weight_cap: float | None = field(
        default=None,
        metadata={
            "help": "Decoupled PPO: tokens whose behaviour weight exp(prox - behav) exceeds this are dropped "
            "(the legacy form of offpolicy_correction 'mis'; read only when offpolicy_correction is auto)."
        },
    )
    offpolicy_correction: str = field(
        default="auto",
        metadata={
            "help": "Train/rollout mismatch correction on rho = exp(prox - behav) (docs/offpolicy.md): tis "
            "(weight min(rho, C)), mis (drop tokens with rho > C), seq_tis / seq_mis (the same on the sequence "
            "ratio, offpolicy_seq_ratio), geo_mask (drop sequences whose geometric-mean ratio is outside "
            "[1/C_low, C]), icepop (drop tokens outside [1/C_low, C]), cispo (CISPO objective + tis), none (no "
            "weight: the PPO ratio and clip act against the behaviour logprobs, stale samples included). "
            "'auto': use_decoupled_loss's weights when it is set, else tis.",
            "choices": ["auto", "none", "tis", "mis", "seq_tis", "seq_mis", "geo_mask", "icepop", "cispo"],
        },
    )
    offpolicy_cap: float = field(
        default=2.0, metadata={"help": "C: the upper ratio threshold of offpolicy_correction.", "min": 1.0}
    )
    offpolicy_cap_low: float | None = field(
        default=None,
        metadata={"help": "C_low: icepop/geo_mask drop ratios below 1/C_low; None: offpolicy_cap.", "min": 1.0},
    )
    offpolicy_seq_ratio: str = field(
        default="product",
        metadata={
            "help": "Sequence ratio of seq_tis/seq_mis: product of token ratios, or their geometric mean.",
            "choices": ["product", "geometric"],
        },
    )
    truncation_replay: bool = field(
        default=False,
        metadata={
            "help": "Under top-p/top-k/min-p sampling, recompute the sampler's kept tokens from the trainer's logits "
            "(top_k, top_p, min_p below, which must equal gconfig's) and renormalise over them, so every trainer "
            "logprob in a ratio is of the distribution actually sampled (docs/truncated_sampling.md). Truncated "
            "sampling without it is a config error (docs/concepts.md, Config guards)."
        },
    )
    top_k: int = field(
        default=-1, metadata={"help": "Top-k the sampler used (replayed; e.g. ${gconfig.top_k}); <= 0 disables."}
    )
    top_p: float = field(
        default=1.0, metadata={"help": "Top-p the sampler used (replayed; e.g. ${gconfig.top_p}); 1 disables."}
    )
    min_p: float = field(
        default=0.0, metadata={"help": "Min-p the sampler used (replayed; e.g. ${gconfig.min_p}); 0 disables."}
    )
    # ---- additions: advantage normalization, KL form, loss shape, reward shaping, critic
    adv_norm: NormConfig = field(default_factory=NormConfig)
    kl_estimator: str = field(
        default="k1",
        metadata={"help": "KL estimator (k1: d, k2: d^2/2, k3: e^-d - 1 + d).", "choices": ["k1", "k2", "k3"]},
    )
    use_kl_loss: bool = field(
        default=False, metadata={"help": "Add kl_ctl * KL to the loss instead of subtracting it from the rewards."}
    )
    entropy_coeff: float = field(default=0.0, metadata={"help": "Entropy bonus coefficient (loss -= coeff * H)."})
    importance_sampling_level: str = field(
        default="token",
        metadata={"help": "PPO ratio per token, or per sequence (GSPO).", "choices": ["token", "sequence"]},
    )
    loss_agg_mode: str = field(
        default="token-mean",
        metadata={
            "help": "Per-token loss reduction.",
            "choices": ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"],
        },
    )
    loss_agg_norm_len: float = field(
        default=1.0, metadata={"help": "Divides each sequence's token sum in seq-mean-token-sum (Dr.GRPO)."}
    )
    overlong_buffer: int = field(
        default=0, metadata={"help": "DAPO overlong penalty over the last N tokens before max_new_tokens; 0: off."}
    )
    overlong_penalty_factor: float = field(default=1.0, metadata={"help": "Largest overlong penalty."})
    max_new_tokens: int | None = field(
        default=None, metadata={"help": "Generation length limit (needed by overlong_buffer)."}
    )
    mask_no_eos: bool = field(
        default=False, metadata={"help": "Drop responses that do not end with EOS (truncated) from the loss."}
    )
    no_eos_penalty: float | None = field(
        default=None, metadata={"help": "Reward given to responses that do not end with EOS; None keeps theirs."}
    )
    eos_token_ids: list[int] = field(
        default_factory=list,
        metadata={"help": "EOS/stop ids for mask_no_eos/no_eos_penalty; empty reads the model's eos_token_id."},
    )


def _critic_engine() -> TrainEngineConfig:
    return TrainEngineConfig(is_critic=True)


@dataclass
class PPOCriticConfig:
    """The PPO value model: a clipped value-loss fit of the returns the actor computes (GAE)."""

    engine: TrainEngineConfig = field(
        default_factory=_critic_engine,
        metadata={"help": "The value model (is_critic: true builds the 1-output head; path empty = actor's)."},
    )
    group_size: int = field(
        default=1, metadata={"help": "Rows kept together when splitting minibatches (as the actor's).", "min": 1}
    )
    ppo_n_minibatches: int = field(default=1, metadata={"help": "Minibatches per epoch.", "min": 1})
    ppo_n_epochs: int = field(default=1, metadata={"help": "Passes over each batch.", "min": 1})
    eps_clip_value: float | None = field(
        default=None, metadata={"help": "Clip new values to old +- this in the value loss; None: no clip."}
    )

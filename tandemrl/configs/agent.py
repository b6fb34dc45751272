"""Config of the agent workflow and its OpenAI-compatible proxy (docs/agents.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandemrl.configs.experiment import GRPOConfig


@dataclass
class AgentConfig:
    """How agent episodes run and how their calls become training samples."""

    agent: str = field(
        default="", metadata={"help": "The agent function as 'module:function' (async def run(client, sample))."}
    )
    mode: str = field(
        default="prefix",
        metadata={
            "help": "When the chat template re-renders history differently: 'prefix' keeps the model's own "
            "tokens and appends the new turns; 'fork' starts a new training sample.",
            "choices": ["prefix", "fork"],
        },
    )
    granularity: str = field(
        default="trajectory",
        metadata={
            "help": "'trajectory': one sample per stitched trajectory; 'turn': one sample per model call.",
            "choices": ["trajectory", "turn"],
        },
    )
    turn_discount: float = field(
        default=1.0, metadata={"help": "Discount of later turns' rewards to earlier turns, in (0, 1]."}
    )
    tool_parser: str = field(default="qwen2", metadata={"help": "Parser of tool calls in the model's output."})
    chat_template: str | None = field(
        default=None, metadata={"help": "Chat template (jinja text or a file path); None uses the tokenizer's."}
    )
    enable_thinking: bool = field(default=False, metadata={"help": "Passed to the chat template."})
    host: str = field(default="127.0.0.1", metadata={"help": "Address the proxy binds to."})
    max_context_len: int | None = field(
        default=None, metadata={"help": "Prompt + output token limit per call; None: the server's.", "min": 1}
    )
    episode_timeout: float | None = field(
        default=None, metadata={"help": "Seconds an agent run may take; a timed-out run drops its group."}
    )


@dataclass
class AgentGRPOConfig(GRPOConfig):
    """GRPO whose rollouts are agent episodes (``examples/gsm8k_agent.py``)."""

    agent: AgentConfig = field(default_factory=AgentConfig)

"""GRPO on GSM8K with a calculator-tool agent written against the openai client.

    python -m tandemrl.launchers.local examples/gsm8k_agent.py --config examples/gsm8k_agent.yaml \
        train_dataset.path=../shared/data/gsm8k

Each episode runs ``calculator_agent`` through the agent proxy (docs/agents.md): the model may
call ``calculator`` (Qwen2 ``<tool_call>`` format, parsed by the proxy) up to ``MAX_TOOL_CALLS``
times, then answers; the reward is GSM8K correctness of the final answer.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
from typing import Any

from tandemrl.algorithms.ppo import PPOActor
from tandemrl.configs.agent import AgentGRPOConfig
from tandemrl.rewards.gsm8k import gsm8k_reward_fn
from tandemrl.trainers.entry import load_config_or_exit
from tandemrl.trainers.rl_loop import RLTrainer, ppo_train_step
from tandemrl.utils.cli import run_main
from tandemrl.workflows.agent import AgentWorkflow

MAX_TOOL_CALLS = 2
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
SYSTEM = (
    "You can call a calculator: write <tool_call>\n"
    '{"name": "calculator", "arguments": {"expression": "48/2"}}\n</tool_call> and wait for the result.'
)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The value of a + - * / expression, or an error message for the model."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("unsupported expression")

    try:
        return f"{ev(ast.parse(expression[:200], mode='eval').body):g}"
    except (ValueError, SyntaxError, ZeroDivisionError, TypeError) as e:
        return f"error: {e}"


async def calculator_agent(client: Any, sample: dict[str, Any]) -> float:
    """Ask, run calculator calls, and score the final answer."""
    import openai

    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, *sample["messages"]]
    answer = ""
    for _ in range(MAX_TOOL_CALLS + 1):
        try:
            r = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        except openai.BadRequestError:  # the context is full: score what we have
            break
        msg = r.choices[0].message
        answer = msg.content or ""
        if not msg.tool_calls:
            break
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            try:
                expr = str(json.loads(call.function.arguments).get("expression", ""))
            except (json.JSONDecodeError, AttributeError):
                expr = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expr)})
    return await asyncio.to_thread(gsm8k_reward_fn, None, answer, None, None, answer=sample["answer"])


def main(argv: list[str]) -> None:
    config, _ = load_config_or_exit(argv, AgentGRPOConfig)
    trainer = RLTrainer(config, name="grpo-agent")
    actor = PPOActor(config.actor, trainer.actor_engine)
    # config.agent is the agent section (AgentConfig: proxy and episode settings); its field `agent` names the
    # agent function, 'module:function' (agent.agent=my_pkg.agents:run on the command line); empty: this file's.
    agent = config.agent.agent or calculator_agent
    workflow = AgentWorkflow(agent, trainer.gconfig, trainer.tokenizer, config.agent)
    _, eval_workflow = trainer.rlvr_workflows(gsm8k_reward_fn)
    trainer.run(workflow, ppo_train_step(actor, ref=trainer.reference()), eval_workflow)
    trainer.close()


if __name__ == "__main__":
    run_main(main)

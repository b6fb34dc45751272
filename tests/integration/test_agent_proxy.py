"""The agent proxy on the real vLLM server, driven only through the official openai client.

The tiny random model never emits tool calls by itself, so the agents here force the model's
output with vLLM structured outputs (a regex sent through the openai client's ``extra_body``)
and use a test chat template that renders tools in Qwen2's ``<tool_call>`` format. The
tokens, logprobs and versions are still the server's: the proxy, the client, the server and
the stitching are real.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import openai
import psutil
import pytest
import requests
import torch

from tandemrl.algorithms.ppo import PPOActor
from tandemrl.api.inference import ModelRequest, ModelResponse
from tandemrl.configs.agent import AgentConfig
from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.configs.ppo import PPOActorConfig
from tandemrl.configs.rollout import GenerationHyperparameters, InferenceClientConfig
from tandemrl.inference.remote import RemoteInferenceClient
from tandemrl.utils import stats_tracker
from tandemrl.workflows.agent import AgentWorkflow, turn_returns
from tandemrl.workflows.proxy import AgentProxy
from tandemrl.workflows.proxy.render import ChatRenderer, normalize_messages

pytestmark = pytest.mark.slow

# Qwen2-style turns; tools listed in a system turn; assistant tool calls as <tool_call>{json}</tool_call>.
TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + ASSISTANT_CONTENT }}"
    "{%- for c in m.tool_calls or [] %}"
    '{{- \'<tool_call>\\n{"name": "\' + c.function.name + \'", "arguments": \' + (c.function.arguments | tojson) '
    "+ '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
KEEP_TEMPLATE = TOOL_TEMPLATE.replace("ASSISTANT_CONTENT", "m.content")
# Drops every earlier assistant turn's <think> block, as reasoning models' templates do.
DROP_THINK_TEMPLATE = TOOL_TEMPLATE.replace("ASSISTANT_CONTENT", "m.content.split('</think>')[-1]")

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


def call_regex(a: int, b: int) -> str:
    args = f'\\{{"a": {a}, "b": {b}\\}}'
    return '<tool_call>\\n\\{"name": "add", "arguments": ' + args + "\\}\\n</tool_call>"


def forced(regex: str) -> dict[str, Any]:
    return {"structured_outputs": {"regex": regex}}


class Tap:
    """Forwards to the real engine and keeps each request's prompt and response (ground truth)."""

    def __init__(self, engine: RemoteInferenceClient) -> None:
        self.engine = engine
        self.calls: list[tuple[list[int], ModelResponse]] = []

    def get_version(self) -> int:
        return self.engine.get_version()

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        resp = await self.engine.agenerate(req)
        self.calls.append((list(req.input_ids), resp))
        return resp


@pytest.fixture(scope="module")
def engine(vllm_server: Any) -> Any:
    eng = RemoteInferenceClient.for_backend("vllm", InferenceClientConfig(request_retries=1, setup_timeout=60))
    eng.initialize([vllm_server.proc.address])
    eng.set_version(3)  # tokens the server leaves unlabelled carry it
    yield eng
    eng.destroy()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def gconfig() -> GenerationHyperparameters:
    return GenerationHyperparameters(n_samples=1, max_new_tokens=128, temperature=1.0)


async def chat(client: openai.AsyncOpenAI, stream: bool, **kw: Any) -> dict[str, Any]:
    """One chat call as an assistant message dict (streamed deltas are assembled like an agent would)."""
    if not stream:
        r = await client.chat.completions.create(model="policy", **kw)
        msg = r.choices[0].message.model_dump(exclude_none=True)
        msg["finish_reason"] = r.choices[0].finish_reason
        return msg
    content, calls, finish = "", {}, None
    async for chunk in await client.chat.completions.create(model="policy", stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            calls.setdefault(c.index, {"id": c.id, "type": "function", "function": {"name": "", "arguments": ""}})
            calls[c.index]["function"]["name"] += c.function.name or ""
            calls[c.index]["function"]["arguments"] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    msg: dict[str, Any] = {"role": "assistant", "content": content or None, "finish_reason": finish}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


def tool_agent(stream: bool):
    async def run(client: openai.AsyncOpenAI, sample: dict[str, Any]) -> float:
        messages: list[dict[str, Any]] = [{"role": "user", "content": sample["question"]}]
        for a, b in ((1, 2), (30, 4)):
            msg = await chat(client, stream, messages=messages, tools=[ADD_TOOL], extra_body=forced(call_regex(a, b)))
            assert msg.pop("finish_reason") == "tool_calls", msg
            messages.append(msg)
            for call in msg["tool_calls"]:
                args = json.loads(call["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] + args["b"])})
        msg = await chat(client, stream, messages=messages, tools=[ADD_TOOL], extra_body=forced("The answer is 3[0-9]"))
        assert msg["finish_reason"] == "stop" and "tool_calls" not in msg, msg
        return 1.0 if msg["content"] == "The answer is 34" else 0.5

    return run


def one_row(batch: dict[str, torch.Tensor], i: int = 0) -> dict[str, list]:
    n = int(batch["attention_mask"][i].sum())
    return {k: batch[k][i, :n].tolist() for k in ("input_ids", "loss_mask", "logprobs", "versions", "constrained")}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_tool_agent_trajectory_is_the_servers_tokens(
    engine: Any, tokenizer: Any, stream: bool, tiny_model_dir: str
) -> None:
    tap = Tap(engine)
    scope = f"agent-tools-{stream}"
    wf = AgentWorkflow(tool_agent(stream), gconfig(), tokenizer, AgentConfig(chat_template=KEEP_TEMPLATE), scope)
    batch = asyncio.run(wf.arun_episode(tap, {"question": "What is 1 + 2 + 30 + 4?"}))
    assert batch is not None and batch["input_ids"].shape[0] == 1
    row = one_row(batch)
    assert len(tap.calls) == 3
    # The sample is the last call's prompt + output; each call's prompt extends the previous call's tokens.
    seq: list[int] = []
    expect_mask: list[int] = []
    expect_lp: list[float] = []
    for prompt, resp in tap.calls:
        assert prompt[: len(seq)] == seq
        glue = prompt[len(seq) :]
        expect_mask += [0] * len(glue) + [1] * len(resp.output_tokens)
        expect_lp += [0.0] * len(glue) + resp.output_logprobs
        seq = prompt + resp.output_tokens
    assert row["input_ids"] == seq
    assert row["loss_mask"] == expect_mask
    assert row["logprobs"] == pytest.approx(expect_lp, abs=1e-6)
    assert set(row["versions"][i] for i, m in enumerate(row["loss_mask"]) if m) == {3}
    # What the model generated, and what came from the tools (mask 0 between the calls).
    outs = [tokenizer.decode(r.output_tokens) for _, r in tap.calls]
    assert outs[0].startswith('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert outs[2].startswith("The answer is 3")
    between = tokenizer.decode(tap.calls[1][0][len(tap.calls[0][0]) + len(tap.calls[0][1].output_tokens) :])
    assert "<tool_response>\n3\n</tool_response>" in between and "<|im_start|>assistant\n" in between
    between = tokenizer.decode(tap.calls[2][0][len(tap.calls[1][0]) + len(tap.calls[1][1].output_tokens) :])
    assert "<tool_response>\n34\n</tool_response>" in between
    stats = stats_tracker.get(scope).export()
    assert stats[f"{scope}/agent_calls"] == 3 and stats[f"{scope}/agent_fork"] == 0
    assert stats[f"{scope}/agent_extend"] + stats[f"{scope}/agent_repair"] == 2
    assert float(batch["rewards"][0]) in (1.0, 0.5)
    if not stream:
        b = check_forced_tokens_leave_the_update(batch, row, tokenizer.decode(tap.calls[2][1].output_tokens))
        # The tokens the regex limited (digits) but did not force: against the server's constrained logprob the
        # unconstrained trainer weighs them by the allowed mass, far below 1; the actor weighs them 1.
        before, after = constrained_weights(b, tiny_model_dir)
        print(f"constrained tokens: behav_imp_weight {before} before, {after} after")  # docs/offpolicy.md
        assert max(before) < 0.5 and after == [1.0] * len(before), (before, after)


def check_forced_tokens_leave_the_update(batch: dict[str, torch.Tensor], row: dict[str, list], last: str) -> None:
    """Every call had a regex constraint: all outputs are marked ``constrained``. vLLM returns
    logprob exactly 0.0 where the regex left one token; the trainer drops those from its action
    mask and keeps the others, e.g. the answer's last digit (a choice among ten)."""
    assert row["constrained"] == row["loss_mask"]
    generated = [t for t, m in enumerate(row["loss_mask"]) if m]
    forced = [t for t in generated if row["logprobs"][t] == 0.0]
    assert len(forced) > len(generated) / 2, (len(forced), len(generated))  # the tool calls are literals
    digit = generated[-1] if last[-1].isdigit() else generated[-2]  # the last output token may be EOS
    assert last.startswith("The answer is 3") and digit not in forced, last
    config = PPOActorConfig(engine=TrainEngineConfig(path="unused"), group_size=1)
    b = PPOActor(config, engine=None).compute_advantages(batch)  # no torch.distributed: no engine needed
    kept = [t + 1 for t, a in enumerate(b["action_mask"][0].tolist()) if a]  # position t emits token t + 1
    assert kept == [t for t in generated if t not in forced]
    assert b["limited_mask"][0].tolist() == b["action_mask"][0].tolist()  # every kept token was constrained
    return b


def constrained_weights(b: dict[str, torch.Tensor], model_dir: str) -> tuple[list[float], list[float]]:
    """behav_imp_weight (token TIS, cap 5) of the kept tokens of a constrained call, with the trainer's logprobs
    of the same model (transformers, fp32, temperature 1): against the server's constrained logprob, and as the
    actor weighs them (constrained.behaviour_for_weights)."""
    from transformers import AutoModelForCausalLM

    from tandemrl.algorithms.constrained import behaviour_for_weights
    from tandemrl.algorithms.offpolicy import Correction, correction_weights

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n = int(b["attention_mask"][0].sum())
    ids = b["input_ids"][:1, :n]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    trainer = torch.zeros(1, b["action_mask"].shape[1])
    trainer[0, : n - 1] = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]  # position t: the logprob of token t + 1
    action, behav, tis = b["action_mask"], b["behav_logp"], Correction("tis", 5.0)
    before = correction_weights(trainer, behav, action, tis)["weight"][action].tolist()
    fixed = behaviour_for_weights(behav, trainer, b["limited_mask"])
    return before, correction_weights(trainer, fixed, action, tis)["weight"][action].tolist()


def think_agent(mode_out: dict[str, Any]):
    async def run(client: openai.AsyncOpenAI, sample: dict[str, Any]) -> list[float]:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        r = await client.chat.completions.create(
            model="policy", messages=messages, extra_body=forced("<think>ok</think>Hello")
        )
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        mode_out["messages"] = messages
        await client.chat.completions.create(model="policy", messages=messages, extra_body=forced("Bye"))
        return [0.5, 1.0]

    return run


@pytest.mark.parametrize("mode", ["prefix", "fork"])
def test_template_that_drops_reasoning_is_repaired_or_forked(engine: Any, tokenizer: Any, mode: str) -> None:
    tap, seen = Tap(engine), {}
    scope = f"agent-think-{mode}"
    config = AgentConfig(chat_template=DROP_THINK_TEMPLATE, mode=mode, turn_discount=0.5)
    wf = AgentWorkflow(think_agent(seen), gconfig(), tokenizer, config, scope)
    batch = asyncio.run(wf.arun_episode(tap, {"question": "unused"}))
    assert batch is not None
    (p1, r1), (p2, r2) = tap.calls
    first = p1 + r1.output_tokens
    assert "<think>ok</think>Hello" in tokenizer.decode(r1.output_tokens)
    # The re-rendered history lost the model's <think> block: it does not extend what the model saw.
    rendered = ChatRenderer(tokenizer, DROP_THINK_TEMPLATE).prompt_ids(normalize_messages(seen["messages"]), None)
    assert rendered[: len(first)] != first and "<think>" not in tokenizer.decode(rendered)
    stats = stats_tracker.get(scope).export()
    returns = turn_returns([0.5, 1.0], 2, 0.5)  # [1.0, 1.0]
    if mode == "prefix":  # one sample: the model's own tokens, then the new user turn
        assert p2[: len(first)] == first
        assert tokenizer.decode(p2[len(first) :]) == "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
        row = one_row(batch)
        assert batch["input_ids"].shape[0] == 1 and row["input_ids"] == p2 + r2.output_tokens
        glue = len(p2) - len(first)
        assert row["loss_mask"] == [0] * len(p1) + [1] * len(r1.output_tokens) + [0] * glue + [1] * len(
            r2.output_tokens
        )
        assert stats[f"{scope}/agent_repair"] == 1 and stats[f"{scope}/agent_fork"] == 0
        assert batch["rewards"].tolist() == [returns[0]]
    else:  # two samples: what the model saw each time, trained only on its own outputs
        assert p2 == rendered
        assert batch["input_ids"].shape[0] == 2
        rows = [one_row(batch, 0), one_row(batch, 1)]
        assert rows[0]["input_ids"] == first and rows[1]["input_ids"] == p2 + r2.output_tokens
        assert rows[0]["loss_mask"] == [0] * len(p1) + [1] * len(r1.output_tokens)
        assert rows[1]["loss_mask"] == [0] * len(p2) + [1] * len(r2.output_tokens)
        assert rows[1]["logprobs"][len(p2) :] == pytest.approx(r2.output_logprobs, abs=1e-6)
        assert stats[f"{scope}/agent_fork"] == 1 and stats[f"{scope}/agent_repair"] == 0
        assert batch["rewards"].tolist() == [returns[0], returns[1]]


def non_loopback_ip() -> str:
    found = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET]
    others = [a for a in found if not a.startswith("127.")]
    if not others:
        pytest.skip("this machine has no non-loopback IPv4 address")
    return others[0]


def test_requests_without_the_key_or_from_other_hosts_are_refused(engine: Any, tokenizer: Any) -> None:
    ip = non_loopback_ip()

    async def run() -> None:
        async with AgentProxy(engine, tokenizer, gconfig(), chat_template=KEEP_TEMPLATE) as proxy:
            s = proxy.open_session()
            url = proxy.base_url
            r = await asyncio.to_thread(requests.get, url + "/models", timeout=30)
            assert r.status_code == 401, r.text
            bad = openai.AsyncOpenAI(base_url=url, api_key="not-the-key", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await bad.completions.create(model="policy", prompt="1 + 1 =", max_tokens=2)
            # Bound to 127.0.0.1: another interface's address is not even listening.
            other = openai.AsyncOpenAI(base_url=f"http://{ip}:{proxy.port}/v1", api_key=s.key, max_retries=0)
            with pytest.raises(openai.APIConnectionError):
                await other.models.list()
            assert not s.session.calls
        # Bound to every interface but loopback-only: a peer from another address is refused.
        async with AgentProxy(engine, tokenizer, gconfig(), host="0.0.0.0", allow_remote=False) as proxy:
            s = proxy.open_session()
            other = openai.AsyncOpenAI(base_url=f"http://{ip}:{proxy.port}/v1", api_key=s.key, max_retries=0)
            with pytest.raises(openai.PermissionDeniedError):
                await other.models.list()
            local = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=s.key, max_retries=0)
            assert [m.id for m in (await local.models.list()).data] == ["tandemrl-policy"]

    asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completions_extend_one_trajectory(engine: Any, tokenizer: Any, stream: bool) -> None:
    tap = Tap(engine)

    async def run() -> Any:
        async with AgentProxy(tap, tokenizer, gconfig()) as proxy:
            s = proxy.open_session()
            client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=s.key, max_retries=0)
            texts = []
            prompt = "Natalia sold clips"
            for _ in range(2):
                r = await client.completions.create(model="policy", prompt=prompt, max_tokens=4, stream=stream)
                if stream:
                    text = "".join([c.choices[0].text async for c in r if c.choices])
                else:
                    text = r.choices[0].text
                texts.append(text)
                prompt += text + " then"
            return s.session, texts

    session, texts = asyncio.run(run())
    assert [tokenizer.decode(r.output_tokens, skip_special_tokens=True) for _, r in tap.calls] == texts
    (p1, r1), (p2, r2) = tap.calls
    first = p1 + r1.output_tokens
    # Text in, so the second prompt is re-tokenized: it continues the trajectory iff its tokens extend it.
    extends = p2[: len(first)] == first
    assert [c.link for c in session.calls] == ["new", "extend" if extends else "new"]
    assert session.trajectories[-1].tokens == p2 + r2.output_tokens
    assert set(session.trajectories[-1].constrained) == {0}  # no output constraint: nothing is marked
    assert len(session.trajectories) == (1 if extends else 2)

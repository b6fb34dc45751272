"""The process that runs a verifiers environment for tandemrl: started with the python of the environment's own
virtualenv (verifiers pins ``openai<3``, tandemrl ``openai>=3``), so it imports only the standard library and
``verifiers``, never tandemrl.

    PYTHON verifiers_bridge.py SPEC_JSON

``SPEC_JSON``: ``{"taskset": {"id": ..., ...taskset config}, "harness": {"id": ...}, "runtime": {"type": ...},
"paths": [dirs put first on sys.path]}``. It loads the environment as ``vf eval`` does
(``verifiers.v1.utils.loaders.load_environment``), then speaks JSON lines, one object a line:

- out, first: ``{"ready": true, "tasks": [{"idx", "prompt", "system"}...]}`` or ``{"fatal": "one line"}``;
- in: ``{"id", "task", "base_url", "api_key"}``: one episode of task ``task`` whose model calls go to the
  OpenAI-compatible ``base_url`` with ``api_key`` (tandemrl's agent proxy for one session);
  out: ``{"id", "reward", "rewards", "metrics", "turns"}`` or ``{"id", "error": "one line"}``;
- in: ``{"cancel": id}``: stop that episode (no reply); end of input: stop everything and exit.

Episodes run concurrently on one event loop inside ``env.serving()`` (verifiers' interception server and
shared tools stay up for the process's life).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sys
from typing import Any

_OUT: Any = None  # the protocol's stream: the original stdout (fd 1 itself goes to stderr, see main)


def _line(obj: dict[str, Any]) -> None:
    _OUT.write(json.dumps(obj) + "\n")
    _OUT.flush()


def _one_line(err: BaseException) -> str:
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text[:500]


def _load(spec: dict[str, Any]) -> Any:
    for path in reversed(spec.get("paths") or []):
        sys.path.insert(0, path)
    import verifiers.v1 as vf
    from verifiers.v1.utils.loaders import load_environment

    agent = {"harness": spec.get("harness") or {"id": "null"}, "runtime": spec.get("runtime") or {"type": "subprocess"}}
    config = vf.SingleAgentEnvConfig.model_validate({"taskset": spec["taskset"], "agent": agent})
    return load_environment(config)


def _prompt_text(data: Any) -> str:
    prompt = data.prompt
    if prompt is None or isinstance(prompt, str):
        return prompt or ""
    parts = []
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else getattr(message, "content", "")
        parts.append(content if isinstance(content, str) else json.dumps(content, default=str))
    return "\n".join(parts)


def _outcome(episode: Any) -> dict[str, Any]:
    if len(episode.traces) != 1:
        return {"error": f"the episode ran {len(episode.traces)} agents; tandemrl trains one agent's episodes"}
    trace = episode.traces[0]
    errors = [*episode.errors, *trace.errors]
    if errors or not episode.ok or not trace.ok:
        last = errors[-1] if errors else None
        what = f"{getattr(last, 'type', 'error')}: {getattr(last, 'message', last)}" if last else "not ok"
        return {"error": ("timed out: " if episode.is_timeout or trace.is_timeout else "") + " ".join(what.split())}
    rewards = {k: (None if v is None else float(getattr(v, "value", v))) for k, v in trace.rewards.items()}
    metrics = {k: float(v) for k, v in trace.metrics.items() if v is not None}
    return {"reward": float(trace.reward), "rewards": rewards, "metrics": metrics, "turns": trace.num_turns}


async def _episode(env: Any, tasks: list[Any], req: dict[str, Any]) -> None:
    from verifiers.v1.clients import EvalClientConfig, ModelContext
    from verifiers.v1.env import RunSlot
    from verifiers.v1.types import SamplingConfig

    rid = req["id"]
    key_var = f"TANDEMRL_VF_KEY_{rid}"
    os.environ[key_var] = req["api_key"]  # verifiers reads a client's key from the environment
    try:
        client = EvalClientConfig(base_url=req["base_url"], api_key_var=key_var)
        ctx = ModelContext(model="policy", client=client, sampling=SamplingConfig())
        episode = await env.run_slot(RunSlot(tasks[req["task"]]), ctx)
        _line({"id": rid, **_outcome(episode)})
    except asyncio.CancelledError:
        raise
    except Exception as err:  # noqa: BLE001 - the one line goes back to the episode
        _line({"id": rid, "error": _one_line(err)})
    finally:
        os.environ.pop(key_var, None)


def _forget(running: dict[str, Any], rid: str, _: Any) -> None:
    running.pop(rid, None)


async def _serve(env: Any, tasks: list[Any]) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    running: dict[str, asyncio.Task[None]] = {}
    async with env.serving():
        _line({"ready": True, "tasks": [{"idx": i, "prompt": _prompt_text(t.data)} for i, t in enumerate(tasks)]})
        while line := await reader.readline():
            req = json.loads(line)
            if "cancel" in req:
                task = running.pop(req["cancel"], None)
                if task is not None:
                    task.cancel()
                continue
            rid = req["id"]
            running[rid] = asyncio.ensure_future(_episode(env, tasks, req))
            running[rid].add_done_callback(functools.partial(_forget, running, rid))
        for task in list(running.values()):
            task.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)


def main(argv: list[str]) -> int:
    global _OUT
    here = os.path.dirname(os.path.abspath(__file__))  # its neighbour verifiers.py would shadow the package
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    _OUT = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # whatever the environment (or a program it starts) prints cannot reach the protocol
    sys.stdout = sys.stderr
    spec = json.loads(argv[0])
    try:
        env = _load(spec)
        tasks = list(env.taskset)
    except BaseException as err:  # noqa: BLE001 - one line to the trainer, whatever the environment raised
        _line({"fatal": _one_line(err)})
        return 2
    asyncio.run(_serve(env, tasks))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

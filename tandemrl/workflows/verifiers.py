"""verifiers environments as tandemrl episodes (docs/environments.md, "verifiers").

An environment written for verifiers 0.4 (a taskset with its rubric, a harness that runs the model) runs
unmodified in its own process, :mod:`tandemrl.workflows.verifiers_bridge`, started with the python of a virtualenv
that has verifiers (which pins ``openai<3``; tandemrl's lock has ``openai>=3``). Its model calls go to the agent
proxy of an :class:`~tandemrl.workflows.agent.AgentWorkflow`, so the training rows hold the exact tokens the
server produced, with their logprobs and versions; the episode's reward is the environment's rubric::

    env = VerifiersEnv(config.verifiers)
    workflow = AgentWorkflow(env.agent("rollout"), gconfig, tokenizer, config.agent)

The environment's tasks are the dataset: :func:`ensure_task_rows` writes them once as ``train.jsonl`` and
``test.jsonl`` (a seeded held-out sample of ``test_size`` tasks) with the task's index in ``vf_task``.
An episode the environment fails (it raised, timed out or returned no reward) drops its group with the cause,
like a failing reward. ``python -m tandemrl.workflows.verifiers setup [PACKAGES]`` builds ``.venv-verifiers``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from tandemrl.utils import stats_tracker
from tandemrl.utils.lifeline import lifeline_command
from tandemrl.workflows.agent import EpisodeFailed
from tandemrl.workflows.env_files import build_venv, write_rows

if TYPE_CHECKING:
    from tandemrl.configs.verifiers import VerifiersConfig

BRIDGE = Path(__file__).with_name("verifiers_bridge.py")
SPEC_FILE = "verifiers.json"
VERIFIERS_VERSION = "0.4.0"  # the release the bridge is written against
START_TIMEOUT_S = 600.0  # loading an environment may build its uv program environment the first time


class VerifiersEnv:
    """One environment process for this trainer rank; :meth:`agent` gives the agent function of an AgentWorkflow."""

    def __init__(self, config: VerifiersConfig, log_file: str | None = None) -> None:
        if not config.env:
            raise ValueError("verifiers.env: empty; name the environment's taskset (a module or package name)")
        python = os.path.expanduser(config.python)
        if not os.path.isfile(python):
            raise FileNotFoundError(
                f"verifiers.python: {config.python} does not exist; build it with "
                "`python -m tandemrl.workflows.verifiers setup [ENV_PACKAGES]` (verifiers needs openai<3)"
            )
        self.name = config.env
        spec = {
            "taskset": {"id": config.env, **config.taskset_args},
            "harness": {"id": config.harness},
            "runtime": {"type": config.runtime},
            "paths": [os.path.abspath(p) for p in config.paths],
        }
        if log_file is None:
            fd, log_file = tempfile.mkstemp(prefix="tandemrl-verifiers-", suffix=".log")
            os.close(fd)
        self.log_file = log_file
        env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(python), os.environ.get("PATH", "")])}
        # The environment's python sees its own packages and ``paths`` (also in the tool servers it starts).
        env["PYTHONPATH"] = os.pathsep.join(spec["paths"])
        with open(log_file, "ab") as log:
            self.proc = subprocess.Popen(
                # -P: not the bridge's directory on sys.path; the lifeline stops the process group (the harness
                # programs and tool servers verifiers starts) if this process dies without close()
                lifeline_command([python, "-P", str(BRIDGE), json.dumps(spec)], grace=5.0),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                text=True,
                start_new_session=True,
            )
        self._ids = itertools.count()
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[dict[str, Any]]]] = {}
        self._lock = threading.Lock()
        self.tasks = self._ready(self.proc.stdout)
        self._reader = threading.Thread(target=self._read, name="verifiers-env", daemon=True)
        self._reader.start()

    def _ready(self, out: IO[str] | None) -> list[dict[str, Any]]:
        assert out is not None
        box: dict[str, Any] = {}
        reader = threading.Thread(target=lambda: box.update(line=out.readline()), daemon=True)
        reader.start()
        reader.join(START_TIMEOUT_S)
        line = box.get("line", "")
        reply = json.loads(line) if line.strip().startswith("{") else {}
        if reply.get("ready"):
            return list(reply["tasks"])
        self.close()
        cause = reply.get("fatal") or (
            f"no reply in {START_TIMEOUT_S:.0f} s" if reader.is_alive() else f"exited: {self._log_tail()}"
        )
        raise RuntimeError(f"verifiers env {self.name!r}: {cause} (log: {self.log_file})")

    def _log_tail(self) -> str:
        lines = [x for x in Path(self.log_file).read_text(errors="replace").splitlines() if x.strip()]
        return lines[-1][:300] if lines else "no output"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                reply = json.loads(line)
            except json.JSONDecodeError:
                continue  # not the protocol's (the bridge sends nothing else there)
            with self._lock:
                waiter = self._pending.pop(str(reply.get("id")), None)
            if waiter is not None:
                loop, fut = waiter
                loop.call_soon_threadsafe(_resolve, fut, reply)
        with self._lock:  # the process ended: every episode still waiting fails with its last words
            waiting, self._pending = list(self._pending.values()), {}
        gone = {"error": f"the environment process exited ({self.proc.poll()}): {self._log_tail()}"}
        for loop, fut in waiting:
            loop.call_soon_threadsafe(_resolve, fut, gone)

    def _send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        with self._lock:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()

    async def episode(self, task: int, base_url: str, api_key: str) -> dict[str, Any]:
        """One episode of task ``task`` whose model calls go to ``base_url``: the environment's reply."""
        rid = str(next(self._ids))
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        with self._lock:
            if not self._reader.is_alive():  # the process is gone: nothing would ever answer
                return {"error": f"the environment process exited ({self.proc.poll()}): {self._log_tail()}"}
            self._pending[rid] = (loop, fut)
        try:
            self._send({"id": rid, "task": task, "base_url": base_url, "api_key": api_key})
        except OSError as err:  # it died between the check and the write; the reader fails the future too
            return {"error": f"the environment process is gone ({err})"}
        try:
            return await fut
        except asyncio.CancelledError:
            with self._lock:
                self._pending.pop(rid, None)
            self._send({"cancel": rid})
            raise

    def agent(self, stat_scope: str = "rollout") -> Callable[[Any, dict[str, Any]], Awaitable[float]]:
        """The agent function of an AgentWorkflow whose stats go to ``stat_scope``: one episode of the row's task
        through the client's proxy; the reward is the rubric's, and its parts are logged as ``vf/<name>``."""

        async def run(client: Any, sample: dict[str, Any]) -> float:
            out = await self.episode(int(sample["vf_task"]), str(client.base_url), str(client.api_key))
            if "error" in out:
                raise EpisodeFailed("environment failed", f"verifiers env {self.name!r}: {out['error']}")
            values = {f"vf/{k}": v for k, v in {**out["rewards"], **out["metrics"]}.items() if v is not None}
            stats_tracker.get(stat_scope).scalar(**{"vf/turns": float(out["turns"]), **values})
            return float(out["reward"])

        return run

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # end of input: the process cancels its episodes and exits
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> VerifiersEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resolve(fut: asyncio.Future[dict[str, Any]], reply: dict[str, Any]) -> None:
    if not fut.done():
        fut.set_result(reply)


def task_rows(tasks: list[dict[str, Any]], test_size: int, seed: int) -> dict[str, list[dict[str, Any]]]:
    """The environment's tasks as train/test rows; the test split is a seeded sample of ``test_size`` tasks, so
    the splits cannot share a task."""
    if test_size >= len(tasks):
        raise ValueError(f"verifiers.test_size={test_size}: the environment has only {len(tasks)} tasks")
    held = set(random.Random(seed).sample(range(len(tasks)), test_size))
    rows: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    for t in tasks:  # "answer": the rows carry none, the environment's rubric scores
        row = {"question": t["prompt"] or f"task {t['idx']}", "answer": "(scored by the environment)"}
        rows["test" if t["idx"] in held else "train"].append({**row, "vf_task": t["idx"]})
    return rows


def ensure_task_rows(config: VerifiersConfig, path: str) -> bool:
    """Write the environment's tasks to ``path`` (train.jsonl, test.jsonl, verifiers.json) unless they are there;
    True if written. A directory written from another environment or split is refused, never overwritten."""
    if not path:
        raise ValueError("train_dataset.path: empty; the verifiers environment's tasks are written there")
    spec = {"env": config.env, "taskset_args": config.taskset_args, "test_size": config.test_size, "seed": config.seed}
    spec_file = Path(path) / SPEC_FILE
    if spec_file.is_file():
        if json.loads(spec_file.read_text())["spec"] != spec:
            raise ValueError(f"train_dataset.path: {path} holds another environment's tasks ({spec_file})")
        return False
    with VerifiersEnv(config) as env:
        tasks = env.tasks
    write_rows(path, task_rows(tasks, config.test_size, config.seed), SPEC_FILE, {"spec": spec, "tasks": len(tasks)})
    return True


def setup(root: str, packages: list[str]) -> str:
    """Build the virtualenv ``root`` with verifiers, uv (verifiers runs harness programs with it) and
    ``packages`` (the environments); returns its python."""
    return build_venv(root, [f"verifiers=={VERIFIERS_VERSION}", "uv", *packages])


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "setup":
        sys.exit("usage: python -m tandemrl.workflows.verifiers setup [ENV_PACKAGES...]  (builds .venv-verifiers)")
    print(setup(".venv-verifiers", sys.argv[2:]))

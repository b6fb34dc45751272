"""OpenEnv environments as tandemrl episodes (docs/environments.md, "OpenEnv").

An environment written for OpenEnv 0.10 (an ``Environment`` served by ``create_app``) runs unmodified in its own
server process, with the python of a virtualenv that has openenv (it brings gradio and fastmcp, which the lock
does not need): :class:`EnvServer` starts it (the local launcher does, once per run, and passes its address in
``TANDEMRL_OPENENV_URL``) or ``openenv.url`` names a running one. Each episode is one WebSocket session
(``/ws``: reset, step, close), so concurrent episodes get their own environment instances::

    env = OpenEnv(config.openenv)
    workflow = AgentWorkflow(env.agent("rollout"), gconfig, tokenizer, config.agent)

An episode resets with the row's ``seed``, shows the model the observation (``observation_field``), sends the
model's reply as the action's ``action_field`` and repeats until the environment says done or ``max_turns``
replies; each step's reward is the reward of the reply that caused it. The model calls go through the agent
proxy, so the rows hold the server's exact tokens. The rows are seeds: :func:`ensure_seed_rows` writes seeds
``0 .. train_size-1`` to ``train.jsonl`` and the next ``test_size`` to ``test.jsonl``. An episode the
environment fails (an error reply, a lost connection) drops its group with the cause, like a failing reward.
``python -m tandemrl.workflows.openenv setup [PACKAGES]`` builds ``.venv-openenv``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandemrl.api.aux_servers import OPENENV_URL_ENV
from tandemrl.api.net import free_port
from tandemrl.utils import stats_tracker
from tandemrl.utils.lifeline import lifeline_command
from tandemrl.workflows.agent import EpisodeFailed
from tandemrl.workflows.env_files import build_venv, write_rows

if TYPE_CHECKING:
    from tandemrl.configs.openenv import OpenEnvConfig

OPENENV_VERSION = "0.10.0"  # the release the protocol here is written against
SPEC_FILE = "openenv.json"


class OpenEnvError(RuntimeError):
    """The environment server answered an error, or the session broke."""


def check_config(config: OpenEnvConfig) -> None:
    """One-line errors for a config that cannot start, before any process does."""
    if not config.app and not config.url:
        raise ValueError("openenv.app and openenv.url: both empty; name the server's app ('module:app') or its URL")
    if config.url and not config.url.startswith(("http://", "https://")):
        raise ValueError(f"openenv.url: {config.url!r} is not an http(s) URL")
    if config.app:
        module, sep, name = config.app.partition(":")
        if not sep or not module or not name:
            raise ValueError(f"openenv.app: must be 'module:app', got {config.app!r}")
        if not os.path.isfile(os.path.expanduser(config.python)):
            raise FileNotFoundError(
                f"openenv.python: {config.python} does not exist; build it with "
                "`python -m tandemrl.workflows.openenv setup [ENV_PACKAGES]`"
            )
    for p in config.paths:
        if not os.path.isdir(p):
            raise FileNotFoundError(f"openenv.paths: {p} is not a directory")
    if not config.action_field:
        raise ValueError("openenv.action_field: empty; name the action's text field")


class EnvServer:
    """An OpenEnv environment server on a free loopback port, in its own process group."""

    def __init__(self, config: OpenEnvConfig, log_file: str | None = None) -> None:
        check_config(config)
        if not config.app:
            raise ValueError("openenv.app: empty; there is no server to start (openenv.url names a running one)")
        self.app, self.port = config.app, free_port("127.0.0.1")
        if log_file is None:
            fd, log_file = tempfile.mkstemp(prefix="tandemrl-openenv-", suffix=".log")
            os.close(fd)
        self.log_file = log_file
        python = os.path.expanduser(config.python)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(os.path.abspath(p) for p in config.paths)}
        cmd = [python, "-P", "-m", "uvicorn", config.app, "--host", "127.0.0.1", "--port", str(self.port)]
        with open(log_file, "ab") as log:
            self.proc = subprocess.Popen(
                lifeline_command([*cmd, "--log-level", "warning"], grace=5.0),  # stops with its starter
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def log_tail(self) -> str:
        lines = [x for x in Path(self.log_file).read_text(errors="replace").splitlines() if x.strip()]
        return lines[-1][:300] if lines else "no output"

    def wait_healthy(self, timeout: float = 120.0) -> None:
        """Block until ``/health`` answers 200; one-line error if the process exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"openenv server {self.app!r} exited ({self.proc.returncode}): {self.log_tail()} "
                    f"(log: {self.log_file})"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"openenv server {self.app!r}: no health in {timeout:.0f} s (log: {self.log_file})")
            time.sleep(0.25)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL whatever is left after ``grace`` seconds."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class Session:
    """One episode's WebSocket session on the environment server (its own environment instance)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/").replace("http", "ws", 1) + "/ws"

    async def __aenter__(self) -> Session:
        import aiohttp

        self._http = aiohttp.ClientSession()
        try:
            self._ws = await self._http.ws_connect(self.url, max_msg_size=0)
        except BaseException:
            await self._http.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if not self._ws.closed:
                await self._ws.send_str(json.dumps({"type": "close"}))
                await self._ws.close()
        finally:
            await self._http.close()

    async def call(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """Send one message, return the reply's ``data``; an error reply raises :class:`OpenEnvError`."""
        import aiohttp

        await self._ws.send_str(json.dumps({"type": kind, "data": data}))
        msg = await self._ws.receive()
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise OpenEnvError(f"the session ended ({msg.type.name}) after a {kind}")
        reply = json.loads(msg.data)
        if reply.get("type") == "error":
            raise OpenEnvError(f"{kind}: {str(reply.get('data', {}).get('message', reply))[:300]}")
        return dict(reply.get("data") or {})


def render(result: dict[str, Any], field: str) -> str:
    """What the model sees of a reset or step result."""
    obs = dict(result.get("observation") or {})
    if field:
        if field not in obs:
            raise OpenEnvError(f"openenv.observation_field: the observation has no {field!r} (it has {sorted(obs)})")
        return str(obs[field])
    obs.pop("metadata", None)
    return json.dumps(obs, ensure_ascii=False)


class OpenEnv:
    """The episodes of one environment server; :meth:`agent` gives the agent function of an AgentWorkflow."""

    def __init__(self, config: OpenEnvConfig, url: str | None = None) -> None:
        self.config = config
        self.url = url or os.environ.get(OPENENV_URL_ENV) or config.url
        if not self.url:
            raise ValueError(
                f"openenv.url: empty and no server started ({OPENENV_URL_ENV} unset); start one with EnvServer"
            )

    async def episode(self, client: Any, seed: int) -> tuple[list[float], bool]:
        """One episode from ``reset(seed)``: the reward of each model reply, and whether the environment ended it."""
        c = self.config
        rewards: list[float] = []
        async with Session(self.url) as env:
            result = await env.call("reset", {**c.reset_args, "seed": seed})
            messages = [{"role": "system", "content": c.system_prompt}] if c.system_prompt else []
            messages.append({"role": "user", "content": render(result, c.observation_field)})
            for _ in range(c.max_turns):
                if result.get("done"):
                    break
                reply = await client.chat.completions.create(model="policy", messages=messages)
                text = reply.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": text})
                result = await env.call("step", {c.action_field: text})
                rewards.append(float(result.get("reward") or 0.0))
                if not result.get("done"):
                    messages.append({"role": "user", "content": render(result, c.observation_field)})
        return rewards, bool(result.get("done"))

    def agent(self, stat_scope: str = "rollout") -> Callable[[Any, dict[str, Any]], Awaitable[list[float]]]:
        """The agent function of an AgentWorkflow whose stats go to ``stat_scope``: one episode of the row's seed
        through the client's proxy; returns one reward per model reply."""
        import aiohttp

        async def run(client: Any, sample: dict[str, Any]) -> list[float]:
            try:
                rewards, done = await self.episode(client, int(sample["seed"]))
            except (OpenEnvError, aiohttp.ClientError, OSError) as err:
                raise EpisodeFailed("environment failed", f"openenv {self.url}: {err}") from None
            stats_tracker.get(stat_scope).scalar(
                **{"openenv/turns": float(len(rewards)), "openenv/done": float(done), "openenv/return": sum(rewards)}
            )
            return rewards

        return run


def seed_rows(config: OpenEnvConfig) -> dict[str, list[dict[str, Any]]]:
    """Rows of reset seeds: train ``0 .. train_size-1``, test the next ``test_size`` (no seed in both)."""
    n, m = config.train_size, config.test_size

    def row(seed: int) -> dict[str, Any]:  # "answer": the rows carry none, the environment scores
        return {"question": f"episode seed {seed}", "answer": "(scored by the environment)", "seed": seed}

    return {"train": [row(s) for s in range(n)], "test": [row(s) for s in range(n, n + m)]}


def ensure_seed_rows(config: OpenEnvConfig, path: str) -> bool:
    """Write the seed rows to ``path`` (train.jsonl, test.jsonl, openenv.json) unless they are there; True if
    written. A directory written for other seeds is refused, never overwritten."""
    if not path:
        raise ValueError("train_dataset.path: empty; the OpenEnv episodes' seed rows are written there")
    spec = {"train_size": config.train_size, "test_size": config.test_size}
    spec_file = Path(path) / SPEC_FILE
    if spec_file.is_file():
        if json.loads(spec_file.read_text())["spec"] != spec:
            raise ValueError(f"train_dataset.path: {path} holds other seed rows ({spec_file})")
        return False
    write_rows(path, seed_rows(config), SPEC_FILE, {"spec": spec})
    return True


def setup(root: str, packages: list[str]) -> str:
    """Build the virtualenv ``root`` with openenv, uvicorn and ``packages`` (the environments); returns its
    python."""
    return build_venv(root, [f"openenv=={OPENENV_VERSION}", "uvicorn", *packages])


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "setup":
        sys.exit("usage: python -m tandemrl.workflows.openenv setup [ENV_PACKAGES...]  (builds .venv-openenv)")
    print(setup(".venv-openenv", sys.argv[2:]))

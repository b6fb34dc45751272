"""Launch one inference server process (vLLM or SGLang) and manage its lifetime.

The server runs in its own session (process group), so ``stop()`` can signal it together
with every engine/worker process it forks: SIGTERM, then SIGKILL after a grace period,
leaving no orphans. It runs under ``tandemrl.utils.lifeline``, which stops that group when
the launching process dies without calling ``stop()`` (SIGKILL, OOM killer). It binds to
loopback by default; with ``token`` (``server_auth``) every route but ``/health``, the
weight-update and dev routes included, needs that bearer token.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from tandemrl.api.net import free_port
from tandemrl.api.types import ParallelStrategy
from tandemrl.inference.request_log import REQUEST_LOG_ENV, RequestLogMiddleware
from tandemrl.inference.server_auth import TOKEN_ENV, TokenMiddleware
from tandemrl.utils.lifeline import lifeline_command

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from tandemrl.api.backend import InferenceBackend

_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])  # so workers can import the extension
_LIVE: set[ServerProcess] = set()


class ServerError(RuntimeError):
    """The server exited or never became healthy; the message ends with its log tail."""


class PortInUseError(ServerError):
    """The server could not bind its port: another process took it after it was picked."""


_BIND_FAILED = "Address already in use"  # errno 98's text in the server's traceback

# A server log line's prefix ("(EngineCore pid=7) ERROR 11-29 04:57:45 [core.py:1512] "), then the causes a
# log names: an exception's last line ("RuntimeError: ...", "vllm.x.EngineDeadError: ...") or argparse's
# "prog: error: ...". Request-level errors (a client's bad request) are not the server's cause of death.
_LOG_PREFIX = re.compile(r"^(?:\([^)]*\) )?(?:[A-Z]+ \d\d-\d\d [\d:]+ \[[^]]*\] )?")
_CAUSE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception)): (\S.*)$|^\S+: error: (\S.*)$")
_REQUEST_ERRORS = ("RequestValidationError", "HTTPException", "ValidationError")


def crash_cause(log_file: str, limit: int = 200) -> str | None:
    """The first error a server's log names (its root cause, usually), cut to ``limit`` characters; None if none.

    An engine's worker that dies logs its own exception first and the front end's wrappers after it
    (``EngineDeadError``), so the first is the one that says what went wrong; a bad flag is argparse's line.
    """
    try:
        with open(log_file, errors="replace") as f:
            for line in f:
                match = _CAUSE.match(_LOG_PREFIX.sub("", line.rstrip()))
                if match is None or match.group(1) in _REQUEST_ERRORS:
                    continue
                cause = f"{match.group(1)}: {match.group(2)}" if match.group(1) else f"error: {match.group(3)}"
                return cause[:limit]
    except OSError:
        return None
    return None


class ServerProcess:
    """A running server: ``address``, ``wait_healthy()``, ``stop()``; a context manager."""

    def __init__(self, backend: InferenceBackend, proc: subprocess.Popen[bytes], host: str, port: int, log_file: str):
        self.backend = backend
        self.proc = proc
        self.host = host
        self.port = port
        self.log_file = log_file
        _LIVE.add(self)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n_lines: int = 20) -> str:
        try:
            with open(self.log_file, errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n_lines:])

    def wait_healthy(self, timeout: float = 600.0, poll_interval: float = 1.0) -> float:
        """Block until the health route answers 200; returns the seconds waited.

        Raises ServerError at once if the process exits (PortInUseError, one line, when it
        could not bind its port), or after ``timeout``.
        """
        req = self.backend.build_health()
        start = time.monotonic()
        while True:
            code = self.proc.poll()
            if code is not None:
                if _BIND_FAILED in self.log_tail(50):
                    raise PortInUseError(
                        f"{self.backend.name} server: port {self.port} on {self.host} is already in use "
                        f"(log {self.log_file})"
                    )
                cause = crash_cause(self.log_file)
                raise ServerError(
                    f"{self.backend.name} server on {self.address} exited with code {code} before it was healthy"
                    + (f": {cause}" if cause else "")
                    + f" (log {self.log_file}); log tail:\n{self.log_tail()}"
                )
            if _http_ok(self.base_url + req.path, req.method, min(5.0, poll_interval * 5)):
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise ServerError(
                    f"{self.backend.name} server on {self.address} not healthy after {timeout:.0f}s "
                    f"(log {self.log_file}); log tail:\n{self.log_tail()}"
                )
            time.sleep(poll_interval)

    def warm_up(self, token: str | None = None, timeout: float = 300.0) -> threading.Thread:
        """Send one two-token generate request (the run's kind: with the sampled tokens' logprobs) from a
        started background thread, which is returned; a failure is logged, never raised.

        A fresh vLLM server compiles its sampler's logprob gather (``torch.compile``) at the first request
        that asks for logprobs: 1.5-2.5 s on a 2-core CPU, which a run's first step waited for. The local
        launcher sends this while the trainer starts, so the two overlap.
        """
        from tandemrl.api.inference import ModelRequest

        req = self.backend.build_generate(
            ModelRequest(rid=f"tandemrl-warm-up-{self.port}", input_ids=[1, 2, 3]), [], 2, 0
        )
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
        body = json.dumps(req.json).encode() if req.json is not None else None
        request = urllib.request.Request(self.base_url + req.path, data=body, headers=headers, method=req.method)

        def send() -> None:
            start = time.monotonic()
            try:
                with urllib.request.urlopen(request, timeout=timeout) as r:
                    r.read()
                logger.info(
                    "%s server %s warmed up in %.1fs", self.backend.name, self.address, time.monotonic() - start
                )
            except (urllib.error.URLError, OSError, ValueError) as e:
                logger.warning("%s server %s: warm-up request failed: %s", self.backend.name, self.address, e)

        thread = threading.Thread(target=send, name=f"tandemrl-warm-up-{self.port}", daemon=True)
        thread.start()
        return thread

    def is_answering(self, timeout: float = 5.0) -> bool:
        """Whether the health route answers 200 within ``timeout`` seconds now."""
        req = self.backend.build_health()
        return _http_ok(self.base_url + req.path, req.method, timeout)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the whole process group (continued first, should it be stopped), SIGKILL whatever is left
        after ``grace`` seconds."""
        _LIVE.discard(self)
        pgid = self.proc.pid  # start_new_session=True: the leader's pid is the group id
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGCONT)  # a stopped process would hold SIGTERM until continued
            _signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and _group_alive(pgid):
                self._reap()
                time.sleep(0.2)
            if _group_alive(pgid):
                _signal_group(pgid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and _group_alive(pgid):
                    self._reap()
                    time.sleep(0.1)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _reap(self) -> None:
        # The leader is our child: collect it so it doesn't linger as a zombie group member.
        self.proc.poll()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def launch_server(
    backend: InferenceBackend,
    model_path: str,
    host: str = "127.0.0.1",
    port: int | None = None,
    strategy: ParallelStrategy | None = None,
    extra: dict[str, Any] | None = None,
    log_file: str | None = None,
    env: dict[str, str] | None = None,
    token: str | None = None,
    request_log: str | None = None,
) -> ServerProcess:
    """Start ``backend``'s server for ``model_path`` (not yet healthy: call ``wait_healthy``).

    ``extra`` adds server flags (``{"max_model_len": 1024}``); ``env`` is applied last.
    vLLM without CUDA gets ``--enforce-eager`` (skips a ~60 s compile warm-up) and a 1 GiB
    KV cache (``VLLM_CPU_KVCACHE_SPACE=1``) unless ``extra``/``env`` say otherwise.
    ``token``: requests need ``Authorization: Bearer <token>`` (vLLM only, see ``server_auth``).
    ``request_log``: the server appends each request's path and times to this file (vLLM only,
    see ``request_log``).
    """
    if not os.path.exists(model_path):
        raise FileNotFoundError(f"launch_server: model_path {model_path!r} does not exist")
    strategy = strategy or ParallelStrategy()
    port = port or free_port(host)
    flags = dict(extra or {})
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, child_env.get("PYTHONPATH")) if p)
    child_env.update(backend.server_env())
    if not _cuda_available():
        backend.cpu_launch(flags, child_env, env or {}, strategy.world_size)
    child_env.update(env or {})
    middleware: list[str] = []
    if token:
        middleware.append(_middleware(backend, TokenMiddleware, "token authentication"))
        child_env[TOKEN_ENV] = token
    if request_log:
        middleware.append(_middleware(backend, RequestLogMiddleware, "request logs"))
        child_env[REQUEST_LOG_ENV] = str(Path(request_log).resolve())
    cmd = backend.server_command(model_path, host, port, strategy, flags)
    for path in middleware:  # vLLM takes one --middleware per class
        cmd += ["--middleware", path]
    if log_file is None:
        fd, log_file = tempfile.mkstemp(prefix=f"tandemrl-{backend.name}-{port}-", suffix=".log")
        os.close(fd)
    else:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        log.write(f"$ {json.dumps(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            lifeline_command(cmd),  # the server's group is stopped if this process dies without stop()
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env,
            start_new_session=True,
        )
    return ServerProcess(backend, proc, host, port, log_file)


def _middleware(backend: InferenceBackend, cls: type, what: str) -> str:
    """Import path of an ASGI middleware class for the server's ``--middleware`` flag."""
    if "middleware" not in backend.features:
        raise ValueError(f"launch_server: {what} is not implemented for {backend.name} servers")
    return f"{cls.__module__}.{cls.__qualname__}"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _http_ok(url: str, method: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=timeout) as r:
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process left in the group?"""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Orphaned zombies still count for killpg where PID 1 does not reap them (e.g. docker
    # without --init); on Linux look for a member that is actually running.
    if not os.path.isdir("/proc"):
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


@atexit.register
def _stop_leftovers() -> None:
    """Interpreter exit without ``stop()`` (e.g. an uncaught error) must not leak servers."""
    for server in list(_LIVE):
        server.stop(grace=5.0)

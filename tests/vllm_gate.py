"""A test-only vLLM hook that holds a request between tokens until the test lets it go on.

Tests that race a real server (pause while a request is decoding) must not depend on how
fast the machine decodes. The session server runs :class:`GateScheduler` as its scheduler
(``--scheduler-cls vllm_gate.GateScheduler``; it runs in the engine core process, between steps)
and :class:`ArrivalWitness` as a logits processor (it runs in the API server), with
``$TANDEMRL_TEST_GATE`` naming a directory. A test arms a :class:`Gate` there with a prompt: every request whose prompt starts
with it, once it has produced a token, stops before each further token and asks the test
over a Unix socket; it decodes one more token only when the test grants one. So a request
cannot finish before the test pauses the server, and the pause lands after exactly as many
tokens as the test granted. Unarmed, the hook does nothing.

While a control call (a pause, a sleep) is on its way, the test does not grant a token outright:
it answers ``c``, and the held engine steps on only once a client message waits in its own input
queue. The engine reads that queue between steps, so the call acts after at most one more token
per message that reaches the engine, however slowly the HTTP call travels on a loaded machine.

Wire format (one connection per message, newline-terminated): ``held N q`` from the engine
(N tokens so far; ``q``: it can see its input queue; it then waits for one byte back: ``g``
steps now, ``c`` steps once a client message is queued or a later ``g`` comes), ``arrived`` from
the API server for a request whose ``sampling_params.extra_args`` has ``tandemrl_witness`` (it
reached the server), ``done`` from the test's own pause thread.
"""

from __future__ import annotations

import json
import os
import queue
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GATE_ENV = "TANDEMRL_TEST_GATE"
SOCKET_NAME = "gate.sock"
ARMED_NAME = "armed.json"
HOLD_LIMIT_S = 300.0  # the engine stops waiting for a grant (a test died): the server never wedges
POLL_S = 0.002  # how often a ``c`` hold looks at the input queue


def _tell(gate_dir: str, line: str) -> None:
    """Send ``line`` to the armed test, expecting no answer. No test: no-op."""
    _hold(gate_dir, line, None, wait_reply=False)


def _hold(gate_dir: str, line: str, inbox: queue.Queue | None, wait_reply: bool = True) -> None:
    """Send ``line``; then wait for ``g``, or after ``c`` until ``inbox`` has a message or ``g`` comes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(HOLD_LIMIT_S)
        try:
            s.connect(os.path.join(gate_dir, SOCKET_NAME))
            s.sendall(line.encode() + b"\n")
            if not wait_reply or s.recv(1) != b"c" or inbox is None:
                return
            deadline = time.monotonic() + HOLD_LIMIT_S
            while inbox.empty() and time.monotonic() < deadline:
                if select.select([s], [], [], POLL_S)[0]:
                    return  # a later grant, or the test closed the connection
        except OSError:
            return


def _engine_input_queue() -> queue.Queue | None:
    """The engine core's queue of client messages: the busy loop that called us owns it."""
    frame = sys._getframe(1)
    while frame is not None:
        inbox = getattr(frame.f_locals.get("self"), "input_queue", None)
        if isinstance(inbox, queue.Queue):
            return inbox
        frame = frame.f_back
    return None


try:  # the server side needs vLLM; the test side (Gate) does not
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.sample.logits_processor import LogitsProcessor
except ImportError:  # pragma: no cover - only where vLLM is not installed
    LogitsProcessor = Scheduler = object  # type: ignore[assignment,misc]


def _armed_prompt(gate_dir: str) -> list[int] | None:
    try:
        return json.loads(Path(gate_dir, ARMED_NAME).read_text())
    except (OSError, ValueError, TypeError):
        return None


class GateScheduler(Scheduler):  # type: ignore[misc,valid-type]
    """Engine core side: before each step, holds every running request of the armed prompt that
    has produced a token (so: before each token after its first) until the test answers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate_dir = os.environ.get(GATE_ENV)
        self.inbox: queue.Queue | None = None  # the engine's input queue, found on the first hold

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        armed = _armed_prompt(self.gate_dir) if self.gate_dir else None
        for req in list(self.running) if armed else ():
            if req.num_output_tokens and list(req.prompt_token_ids[: len(armed)]) == armed:
                self.inbox = self.inbox or _engine_input_queue()
                tag = " q" if self.inbox is not None else ""
                _hold(self.gate_dir, f"held {req.num_output_tokens}{tag}", self.inbox)  # type: ignore[arg-type]
        return super().schedule(*args, **kwargs)


class ArrivalWitness(LogitsProcessor):  # type: ignore[misc,valid-type]
    """API server side: says ``arrived`` for a request whose extra_args ask for a witness; it never
    changes the logits."""

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        pass

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        gate_dir = os.environ.get(GATE_ENV)
        if gate_dir and (sampling_params.extra_args or {}).get("tandemrl_witness"):
            _tell(gate_dir, "arrived")

    def is_argmax_invariant(self) -> bool:
        return True  # the witness is in validate_params; apply is a no-op

    def update_state(self, batch_update: Any) -> None:
        pass

    def apply(self, logits: Any) -> Any:
        return logits


class Gate:
    """Test side: arm with a prompt, then drive the held request one token at a time."""

    def __init__(self, gate_dir: str | os.PathLike[str], timeout: float = 120.0) -> None:
        self.dir = Path(gate_dir)
        self.timeout = timeout  # bounds every wait; only matters when something is broken
        self.granted = 0
        self.last_held = 0
        self.sees_queue = False  # the last hold could see the engine's input queue
        self._sock: socket.socket | None = None

    def arm(self, prompt: list[int]) -> Gate:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / SOCKET_NAME
        path.unlink(missing_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(8)
        self._sock.settimeout(self.timeout)
        (self.dir / ARMED_NAME).write_text(json.dumps(list(prompt)))
        return self

    def disarm(self) -> None:
        (self.dir / ARMED_NAME).unlink(missing_ok=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        (self.dir / SOCKET_NAME).unlink(missing_ok=True)

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disarm()

    def next_message(self) -> tuple[str, socket.socket]:
        """The next message (``held N``, ``arrived``, ``done``) and its connection (answer ``held``)."""
        assert self._sock is not None, "Gate.arm() first"
        try:
            conn, _ = self._sock.accept()
        except TimeoutError:
            raise TimeoutError(f"vllm_gate: no message from the server in {self.timeout}s") from None
        conn.settimeout(self.timeout)
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(64)
            if not chunk:
                break
            data += chunk
        return data.decode().strip(), conn

    def expect(self, kind: str) -> tuple[str, socket.socket]:
        msg, conn = self.next_message()
        if not msg.startswith(kind):
            conn.close()
            raise AssertionError(f"vllm_gate: expected {kind!r}, got {msg!r}")
        return msg, conn

    def wait_held(self) -> socket.socket:
        """Block until the armed request is held (it has produced ``self.last_held`` >= 1 tokens)."""
        msg, conn = self.expect("held")
        self._note_hold(msg)
        return conn

    def _note_hold(self, msg: str) -> None:
        words = msg.split()
        self.last_held, self.sees_queue = int(words[1]), words[2:] == ["q"]

    def advance(self, held: socket.socket, tokens: int) -> socket.socket:
        """Grant one token at a time until the held request has ``tokens`` tokens; returns the new hold."""
        while self.last_held < tokens:
            held.sendall(b"g")
            held.close()
            self.granted += 1
            held = self.wait_held()
        return held

    def release_until(self, action: Callable[[], Any], held: socket.socket, max_tokens: int) -> Any:
        """Run ``action`` (e.g. a pause) in a thread until it returns. Each hold of the request is
        answered ``c``: the engine steps once a client message (the action's call) waits in its
        input queue, which it reads right after that step, so no token is spent waiting for the call
        to travel. Fails if the request would need more than ``max_tokens`` tokens.
        """
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = action()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e
            _tell(str(self.dir), "done")

        th = threading.Thread(target=run, daemon=True)
        th.start()
        pending = held  # answered ``c``; kept open so that a ``g`` can still free the engine
        try:
            self._step_on_message(pending, action, max_tokens)
            while True:
                msg, c = self.next_message()
                if msg == "done":
                    c.close()
                    break
                if msg.startswith("held"):  # the engine stepped on: that hold is over
                    pending.close()
                    self._note_hold(msg)
                    pending = c
                    self._step_on_message(pending, action, max_tokens)
                else:
                    c.close()
        finally:
            _free(pending)  # the action ended (or failed) with the engine still held: let it go on
        th.join(self.timeout)
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def _step_on_message(self, hold: socket.socket, action: Callable[[], Any], max_tokens: int) -> None:
        if not self.sees_queue:
            raise AssertionError("vllm_gate: the hook cannot see the engine's input queue")
        if self.last_held >= max_tokens:
            raise AssertionError(f"vllm_gate: {self.last_held} tokens granted and '{action}' has not returned")
        hold.sendall(b"c")
        self.granted += 1


def _free(hold: socket.socket) -> None:
    try:
        hold.sendall(b"g")
    except OSError:
        pass  # the engine already stepped on and closed its end
    hold.close()

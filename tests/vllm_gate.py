"""A test-only vLLM hook that holds a request between tokens until the test lets it go on.

Tests that race a real server (pause while a request is decoding) must not depend on how
fast the machine decodes. The session server loads :class:`HoldGate` as a custom logits
processor (``--logits-processors vllm_gate:HoldGate``) with ``$TANDEMRL_TEST_GATE`` naming a
directory. A test arms a :class:`Gate` there with a prompt: every request whose prompt starts
with it, once it has produced a token, stops before each further token and asks the test
over a Unix socket; it decodes one more token only when the test grants one. So a request
cannot finish before the test pauses the server, and the pause lands after exactly as many
tokens as the test granted. Unarmed, the hook does nothing.

Wire format (one connection per message, newline-terminated): ``held N`` from the engine
(N tokens so far; it then waits for one byte back), ``arrived`` from the API server for a
request whose ``sampling_params.extra_args`` has ``tandemrl_witness`` (it reached the
server), ``done`` from the test's own pause thread.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

GATE_ENV = "TANDEMRL_TEST_GATE"
SOCKET_NAME = "gate.sock"
ARMED_NAME = "armed.json"
HOLD_LIMIT_S = 300.0  # the engine stops waiting for a grant (a test died): the server never wedges


def _tell(gate_dir: str, line: str, wait_reply: bool) -> None:
    """Send ``line`` to the armed test; with ``wait_reply`` block until it answers. No test: no-op."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(HOLD_LIMIT_S)
        try:
            s.connect(os.path.join(gate_dir, SOCKET_NAME))
            s.sendall(line.encode() + b"\n")
            if wait_reply:
                s.recv(1)
        except OSError:
            return


try:  # the server side needs vLLM; the test side (Gate) does not
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
except ImportError:  # pragma: no cover - only where vLLM is not installed
    LogitsProcessor = object  # type: ignore[assignment,misc]


class HoldGate(LogitsProcessor):  # type: ignore[misc,valid-type]
    """Server side: holds requests of the armed prompt before each token after their first."""

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        self.gate_dir = os.environ.get(GATE_ENV)
        self.held: dict[int, list[int]] = {}  # batch index -> the request's live output token list

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        gate_dir = os.environ.get(GATE_ENV)
        if gate_dir and (sampling_params.extra_args or {}).get("tandemrl_witness"):
            _tell(gate_dir, "arrived", wait_reply=False)

    def is_argmax_invariant(self) -> bool:
        return False  # must run for greedy requests too; it never changes the logits

    def _armed_prompt(self) -> list[int] | None:
        try:
            return json.loads(Path(self.gate_dir, ARMED_NAME).read_text())  # type: ignore[arg-type]
        except (OSError, ValueError, TypeError):
            return None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.held.pop(index, None)
        armed = self._armed_prompt() if self.gate_dir and batch_update.added else None
        for index, _params, prompt, output in batch_update.added:
            self.held.pop(index, None)
            if armed and prompt is not None and list(prompt[: len(armed)]) == armed:
                self.held[index] = output
        for a, b, direction in batch_update.moved:
            ta, tb = self.held.pop(a, None), self.held.pop(b, None)
            if ta is not None:
                self.held[b] = ta
            if tb is not None and direction == MoveDirectionality.SWAP:
                self.held[a] = tb

    def apply(self, logits: Any) -> Any:
        for output in self.held.values():
            if output and self.gate_dir and Path(self.gate_dir, ARMED_NAME).exists():
                _tell(self.gate_dir, f"held {len(output)}", wait_reply=True)
        return logits


class Gate:
    """Test side: arm with a prompt, then drive the held request one token at a time."""

    def __init__(self, gate_dir: str | os.PathLike[str], timeout: float = 120.0) -> None:
        self.dir = Path(gate_dir)
        self.timeout = timeout  # bounds every wait; only matters when something is broken
        self.granted = 0
        self.last_held = 0
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
        self.last_held = int(msg.split()[1])
        return conn

    def advance(self, held: socket.socket, tokens: int) -> socket.socket:
        """Grant one token at a time until the held request has ``tokens`` tokens; returns the new hold."""
        while self.last_held < tokens:
            held.sendall(b"g")
            held.close()
            self.granted += 1
            held = self.wait_held()
        return held

    def release_until(self, action: Callable[[], Any], held: socket.socket, max_tokens: int) -> Any:
        """Run ``action`` (e.g. a pause) in a thread, granting the held request one token at a time
        until ``action`` returns: the engine steps only when granted, and acts on the pause between
        steps. Fails if the request would need more than ``max_tokens`` tokens.
        """
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = action()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e
            _tell(str(self.dir), "done", wait_reply=False)

        th = threading.Thread(target=run, daemon=True)
        th.start()
        conn: socket.socket | None = held
        while True:
            if conn is not None:
                if self.last_held >= max_tokens:
                    raise AssertionError(f"vllm_gate: {self.last_held} tokens granted and '{action}' has not returned")
                conn.sendall(b"g")
                conn.close()
                self.granted += 1
                conn = None
            msg, c = self.next_message()
            if msg == "done":
                c.close()
                if conn is not None:  # the action failed while a token was pending: let the engine go on
                    conn.sendall(b"g")
                    conn.close()
                break
            if msg.startswith("held"):
                self.last_held, conn = int(msg.split()[1]), c
            else:
                c.close()
        th.join(self.timeout)
        if "error" in box:
            raise box["error"]
        return box.get("result")

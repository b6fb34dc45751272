"""Recoverable checkpoints of a training run: engines (DCP) + loop state, saved periodically, loaded on restart.

``recover.mode``: ``disabled`` never saves nor loads; ``auto`` saves every ``recover.freq_*``
and, on start, resumes from a checkpoint if one exists (else starts fresh); ``resume`` is
``auto`` that refuses to start without a checkpoint.

Layout under ``<fileroot>/checkpoints/<experiment>/<trial>/recover``:

* ``engines/<name>/``: each trainable engine's ``save(SaveLoadMeta(weight_format="dcp", with_optim=True))``
  (weights, optimizer, LR schedule, version);
* ``dataloader_rank<r>.pt``: trainer rank r's dataloader position;
* ``pending_rows_rank<r>.pt``: the rows rank r's rollout executor had taken from the dataloader
  but not yet handed out in a trained batch (queued, generating, or generated and waiting), then
  those a synchronous step's refill read and did not use (``tandemrl.trainers.refill``);
* ``ledger_rank<r>.json``: rank r's sample ledger (``tandemrl.rollout.ledger``), read at the same
  moment as its pending rows, with the samples then generated and waiting;
* ``loop_state.json``: the last finished global step, the weight version, the saver's and
  evaluator's counters, the trainer world size and a fingerprint of the pushed weights; at the
  run's last step, ``finished`` with its length and final model (a launcher then starts nothing).

A save is written to ``recover.tmp``, listed in its ``manifest.json`` (``tandemrl.trainers.manifest``)
and replaces ``recover`` only once complete; the checkpoint it replaces is kept as ``recover.prev``
(``recover.keep_previous``). So a crash mid-save leaves the previous checkpoint usable, and a newest
checkpoint damaged later (a truncated shard, a changed file) is named in one line and the run resumes
from ``recover.prev`` instead. Loading re-computes the weight fingerprint and refuses a checkpoint
whose restored weights differ from the saved ones.

Rollouts that were queued or running when the checkpoint was written are not saved (they
came from older weights), but their rows are: the resumed run generates them again, with the
restored weights, before it takes new rows from the dataloader. So every row is trained once,
none skipped, in asynchronous runs too (a synchronous run has no such rows at a step's end).
The samples that were generated and waiting are therefore never trained: the restored ledger
counts them as discarded, reason ``lost_at_restart``. A checkpoint without a ledger file
(written before the ledger existed) starts the ledger at zero.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tandemrl.api.types import FinetuneSpec, SaveLoadMeta
from tandemrl.configs.utils import LOOP_STATE_FILE, RECOVER_DIR, RecoverConfig
from tandemrl.trainers.freq import FreqControl, agree_with_rank0, epochs_finished
from tandemrl.trainers.manifest import ManifestMismatch, check_manifest, write_manifest
from tandemrl.trainers.saver import NOT_FAILURES, Saver, checkpoint_cause, writing_checkpoint
from tandemrl.utils.cli import first_line

RECOVER_MODES = ("disabled", "auto", "resume")
PREVIOUS_SUFFIX = ".prev"


def _reason(e: BaseException) -> str:
    """What a corrupt-checkpoint message quotes of the error: its type and first line."""
    return first_line(e, with_type=True, limit=300)


class CorruptCheckpointError(ValueError):
    """The recoverable checkpoint exists but cannot be used; a ValueError so ``run_main`` prints one line."""


class RecoverableEngine(Protocol):
    """A training engine: ``save``/``load`` are collective over its ranks."""

    def save(self, meta: SaveLoadMeta) -> None: ...

    def load(self, meta: SaveLoadMeta) -> None: ...

    def get_version(self) -> int: ...

    @property
    def has_optimizer(self) -> bool: ...


class StatefulLoader(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RowSource(Protocol):
    """Rollout's rows taken from the dataloader but not yet trained, and its sample ledger
    (RolloutController, WorkflowExecutor)."""

    def recover_state(self) -> tuple[list[dict[str, Any]], dict[str, Any]]: ...

    def replay_first(self, rows: Iterable[dict[str, Any]]) -> None: ...

    def restore_ledger(self, state: dict[str, Any]) -> Any: ...


def pending_rows_file(path: str) -> str:
    return os.path.join(path, f"pending_rows_rank{_rank()}.pt")


def ledger_file(path: str) -> str:
    return os.path.join(path, f"ledger_rank{_rank()}.json")


@dataclass
class LoopState:
    """What the training loop needs, besides the engines, to continue where it stopped."""

    global_step: int  # the last finished step (0-based); the resumed run starts at global_step + 1
    version: int  # weight version of the engines (and of the servers once re-pushed)
    world_size: int  # trainer ranks that wrote it; each has its own dataloader position
    weights_fingerprint: str
    saver: dict[str, Any] = field(default_factory=dict)
    evaluator: dict[str, Any] = field(default_factory=dict)
    recover: dict[str, Any] = field(default_factory=dict)
    finished: bool = (
        False  # written at the run's last step: a launcher then starts nothing (configs.utils.finished_run)
    )
    final_model: str | None = None  # the HF model saved at that step, if any
    length: dict[str, Any] = field(
        default_factory=dict
    )  # total_train_steps / _epochs it finished (a longer run goes on)

    @classmethod
    def from_json(cls, raw: Any, where: str) -> LoopState:
        if not isinstance(raw, dict):
            raise ValueError(f"recover: {where} must hold a JSON object")
        missing = [k for k in ("global_step", "version", "world_size", "weights_fingerprint") if k not in raw]
        if missing:
            raise ValueError(f"recover: {where} lacks {missing}")
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**known)


def weights_fingerprint(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Short digest of float32 values and names, independent of order and of sharding (full tensors)."""
    digests = {}
    for name, t in named_tensors:
        data = t.detach().to("cpu", torch.float32).contiguous().reshape(-1)
        digests[name] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}:{digests[name]};".encode())
    return h.hexdigest()[:16]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank0_value(value: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class RecoverStates:
    """Everything a recoverable checkpoint holds, given to the handler once (the trainer's parts)."""

    engines: Mapping[str, RecoverableEngine]  # the trainer's engines (live); those with an optimizer are saved
    pushed: Any  # the engine whose weights the servers get: its weights are fingerprinted, its version kept
    dataloader: StatefulLoader | None
    saver: Any  # its state_dict: which HF saves are due
    evaluator: Any  # likewise for evaluations
    rollout: RowSource | None = None  # pending rows to generate again and the sample ledger (RL)


class RecoverHandler:
    """Decides when to write a recoverable checkpoint of ``states``, writes it, and loads it on restart."""

    def __init__(self, config: RecoverConfig, ft_spec: FinetuneSpec | None, states: RecoverStates) -> None:
        if config.mode not in RECOVER_MODES:
            raise ValueError(f"recover.mode must be one of {', '.join(RECOVER_MODES)}; got {config.mode!r}")
        self.config = config
        self.ft_spec = ft_spec
        self.states = states
        self.freq_ctl = FreqControl.from_config(config)
        self._corrupt: set[str] = set()  # checkpoints find() skipped as corrupt: never kept as recover.prev

    @property
    def enabled(self) -> bool:
        return self.config.mode != "disabled"

    @property
    def path(self) -> str:
        root = Saver.get_save_root(self.config.fileroot, self.config.experiment_name, self.config.trial_name)
        return os.path.join(root, RECOVER_DIR)

    # ------------------------------------------------------------------ save
    def dump(self, step: int, global_step: int, last: bool = False, final_model: str | None = None) -> bool:
        """Collective: write a checkpoint of the states after ``global_step`` if due; returns whether one was
        written. ``last`` marks the run's final step: with ``save_final`` on, it is written whatever the frequency,
        and marked finished, naming ``final_model`` (the HF model saved at that step, if any)."""
        if not self.enabled:
            return False
        due = self.freq_ctl.check(epochs=epochs_finished(step, self.ft_spec), steps=1)
        if self.freq_ctl.freq_secs is not None:
            due = agree_with_rank0(due)
        if not due and not (last and self.config.save_final):
            return False
        final, tmp = self.path, self.path + ".tmp"
        with writing_checkpoint(tmp, "recover"):
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            _barrier()
            fingerprint = self._write_parts(tmp)
            _barrier()
            if _rank() == 0:
                state = self._loop_state(global_step, fingerprint)
                state.finished, state.final_model = last, final_model if last else None
                if self.ft_spec is not None:
                    spec = self.ft_spec
                    state.length = {
                        "total_train_steps": spec.total_train_steps_override,
                        "total_train_epochs": spec.total_train_epochs,
                    }
                with open(os.path.join(tmp, LOOP_STATE_FILE), "w") as f:
                    json.dump(asdict(state), f, indent=1)
                write_manifest(tmp)
                self._rotate(tmp, final)
                print(
                    f"recover: saved global step {global_step + 1} (version {state.version}, "
                    f"weights {fingerprint}) to {final}",
                    flush=True,
                )
        _barrier()
        return True

    def _write_parts(self, tmp: str) -> str:
        """Every rank: engines, dataloader position, pending rows and ledger into ``tmp``; the weights' fingerprint."""
        s = self.states
        for name, engine in self._trained():
            engine.save(SaveLoadMeta(path=os.path.join(tmp, "engines", name), weight_format="dcp", with_optim=True))
        if s.dataloader is not None:
            torch.save(s.dataloader.state_dict(), os.path.join(tmp, f"dataloader_rank{_rank()}.pt"))
        rows, ledger = s.rollout.recover_state() if s.rollout is not None else ([], None)
        torch.save(rows, pending_rows_file(tmp))
        if ledger is not None:
            with open(ledger_file(tmp), "w") as f:
                json.dump(ledger, f)
        return self._fingerprint(s.pushed)

    def _trained(self) -> list[tuple[str, RecoverableEngine]]:
        """The engines with training state, in the trainer's order (a frozen one is rebuilt from its path)."""
        return [(name, e) for name, e in self.states.engines.items() if e.has_optimizer]

    def _loop_state(self, global_step: int, fingerprint: str) -> LoopState:
        s = self.states
        return LoopState(
            global_step=global_step,
            version=int(s.pushed.get_version()),
            world_size=_world(),
            weights_fingerprint=fingerprint,
            saver=s.saver.state_dict(),
            evaluator=s.evaluator.state_dict(),
            recover={"freq_ctl": self.freq_ctl.state_dict()},
        )

    def _rotate(self, tmp: str, final: str) -> None:
        """The complete ``tmp`` becomes the checkpoint; the one it replaces stays as ``<path>.prev`` (the
        fallback when the newest turns out corrupt) unless ``recover.keep_previous`` is off. A replaced
        checkpoint that this run found corrupt is deleted instead, and the previous one stays."""
        prev = final + PREVIOUS_SUFFIX
        if os.path.exists(final) and final in self._corrupt:
            shutil.rmtree(final)
            self._corrupt.discard(final)
        else:
            shutil.rmtree(prev, ignore_errors=True)
            if os.path.exists(final):
                os.rename(final, prev)
        os.rename(tmp, final)
        if not self.config.keep_previous:
            shutil.rmtree(prev, ignore_errors=True)
        shutil.rmtree(final + ".old", ignore_errors=True)  # the layout before .prev existed

    def _fingerprint(self, pushed: Any) -> str:
        """Every rank takes part in gathering the full weights; rank 0's digest is returned everywhere."""
        params = pushed.iter_hf_params()
        if _rank() == 0:
            return _rank0_value(weights_fingerprint(params))
        for _ in params:
            pass
        return _rank0_value(None)

    # ------------------------------------------------------------------ load
    def candidates(self) -> list[str]:
        """Checkpoint directories to resume from, newest first (a crash between the final renames leaves
        the newest complete one as ``recover.prev``; ``recover.old`` is the layout before ``.prev``)."""
        paths = (self.path, self.path + PREVIOUS_SUFFIX, self.path + ".old")
        return [p for p in paths if os.path.isdir(p)]

    def find(self) -> str | None:
        """The newest checkpoint whose files match its manifest; a corrupt newer one is named in one line
        (``recover: ... is corrupt: FILE: why; resuming from the previous checkpoint P``). Rank 0 decides."""
        found = self.candidates()
        for i, path in enumerate(found):
            try:
                check_manifest(path)
            except ManifestMismatch as e:
                self._corrupt.add(path)
                if i + 1 == len(found):
                    raise CorruptCheckpointError(f"recover: checkpoint {path} is corrupt: {e}") from None
                print(
                    f"recover: checkpoint {path} is corrupt: {e}; resuming from the previous one, {found[i + 1]}",
                    flush=True,
                )
                continue
            return path
        return None

    def _choose(self) -> tuple[str | None, str | None]:
        """Rank 0: (checkpoint to load, None) or (None, the one-line error every rank raises)."""
        try:
            return self.find(), None
        except CorruptCheckpointError as e:
            return None, str(e)

    def load(self) -> LoopState | None:
        """Collective: restore every state from the checkpoint (None: nothing to resume in mode auto/disabled);
        the rollout gets the checkpoint's pending rows to generate before new dataloader rows, and its ledger.

        Raises a one-line error when mode is ``resume`` and there is no checkpoint, or when the
        checkpoint is corrupt or was written by a different number of trainer ranks.
        """
        if not self.enabled:
            return None
        path, error = _rank0_value(self._choose() if _rank() == 0 else None)
        if error is not None:
            raise CorruptCheckpointError(error)
        if path is None:
            if self.config.mode == "resume":
                raise FileNotFoundError(
                    f"recover.mode=resume: no recoverable checkpoint at {self.path} "
                    f"(set recover.mode=auto to start fresh when there is none)"
                )
            return None
        state = self._read_state(path)
        if state.world_size != _world():
            raise CorruptCheckpointError(
                f"recover: checkpoint {path} was written by {state.world_size} trainer ranks, this run has {_world()}"
            )
        self._load_parts(path)
        fingerprint = self._check_weights(path, state)
        s = self.states
        s.saver.load_state_dict(state.saver)
        s.evaluator.load_state_dict(state.evaluator)
        if state.recover:
            self.freq_ctl.load_state_dict(state.recover["freq_ctl"])
        if _rank() == 0:
            self._print_resumed(path, state, fingerprint)
        return state

    def _load_parts(self, path: str) -> None:
        """Every rank: engines, dataloader position, pending rows and ledger from ``path``."""
        s = self.states
        for name, engine in self._trained():
            engine_dir = os.path.join(path, "engines", name)
            try:
                engine.load(SaveLoadMeta(path=engine_dir, weight_format="dcp", with_optim=True))
            except BaseException as e:  # torch's CheckpointException is a BaseException
                if isinstance(e, NOT_FAILURES):
                    raise
                raise CorruptCheckpointError(
                    f"recover: checkpoint {path} is corrupt: cannot load engine '{name}' ({_reason(checkpoint_cause(e))})"
                ) from None
        loader_file = os.path.join(path, f"dataloader_rank{_rank()}.pt")
        try:
            if s.dataloader is not None:
                s.dataloader.load_state_dict(torch.load(loader_file, weights_only=False))
        except Exception as e:
            raise CorruptCheckpointError(f"recover: checkpoint {path} is corrupt: {loader_file}: {_reason(e)}") from e
        if s.rollout is not None:
            s.rollout.replay_first(self._pending_rows(path))
            self._restore_ledger(path, s.rollout)

    def _check_weights(self, path: str, state: LoopState) -> str:
        """The restored weights' fingerprint and version must be the saved ones; the fingerprint."""
        pushed = self.states.pushed
        fingerprint = self._fingerprint(pushed)
        if fingerprint != state.weights_fingerprint:
            raise CorruptCheckpointError(
                f"recover: checkpoint {path} is corrupt: restored weights have fingerprint {fingerprint}, "
                f"the saved ones {state.weights_fingerprint}"
            )
        if int(pushed.get_version()) != state.version:
            raise CorruptCheckpointError(
                f"recover: checkpoint {path} is corrupt: engine version {pushed.get_version()} != {state.version}"
            )
        return fingerprint

    def _print_resumed(self, path: str, state: LoopState, fingerprint: str) -> None:
        print(
            f"recover: resumed from {path} after global step {state.global_step + 1} "
            f"(version {state.version}, weights {fingerprint})",
            flush=True,
        )
        total = self.ft_spec.total_train_steps if self.ft_spec is not None else None
        if total is not None and state.global_step + 1 >= total:
            print(
                f"recover: this run already finished ({state.global_step + 1} of {total} steps in {path}): "
                "nothing left to train; launch with another trial_name, or recover.mode=disabled to start over",
                flush=True,
            )

    @staticmethod
    def _pending_rows(path: str) -> list[dict[str, Any]]:
        file = pending_rows_file(path)
        try:
            rows = torch.load(file, weights_only=False)
        except Exception as e:
            raise CorruptCheckpointError(f"recover: checkpoint {path} is corrupt: {file}: {_reason(e)}") from e
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise CorruptCheckpointError(f"recover: checkpoint {path} is corrupt: {file} must hold a list of rows")
        return rows

    @staticmethod
    def _restore_ledger(path: str, rollout: RowSource) -> None:
        file = ledger_file(path)
        if not os.path.exists(file):
            return  # written before the ledger existed: it starts at zero
        try:
            with open(file) as f:
                rollout.restore_ledger(json.load(f))
        except (OSError, json.JSONDecodeError, ValueError) as e:
            raise CorruptCheckpointError(f"recover: checkpoint {path} is corrupt: {file}: {_reason(e)}") from None

    @staticmethod
    def _read_state(path: str) -> LoopState:
        file = os.path.join(path, LOOP_STATE_FILE)
        try:
            with open(file) as f:
                raw = json.load(f)
            return LoopState.from_json(raw, file)
        except (OSError, json.JSONDecodeError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"recover: checkpoint {path} is corrupt: {file}: {_reason(e)}") from None

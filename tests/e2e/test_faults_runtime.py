"""Runtime fault catalogue, through the real local launcher (issue 12).

Each fault asserts: a one-line error naming what failed, a non-zero exit, no orphan
process, and the last good checkpoint intact and loadable. Covered elsewhere (not repeated):

* trainer ranks SIGKILLed -> launcher tears everything down: test_launcher.py::test_killing_the_trainer_leaves_no_process
* GRPO auto-resume at the next step, weights and version restored: test_recover.py
* reward functions that raise, hang, return NaN or strings, one at a time: test_rewards.py
* a server dying mid-run (client side, fake servers): test_remote_engine.py

Here: torchrun alone SIGKILLed (ranks gone, nothing written after), then ``recover.mode=auto``
resuming SFT with per-step losses bitwise equal to an uninterrupted run; an unwritable or
full checkpoint directory; the launcher SIGKILLed (servers and trainer gone); one of two vLLM
servers SIGKILLed mid-run (the run goes on, disk weight updates on the survivor), then the
other (one line, checkpoints intact); a collective run losing a server stops at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests
from utils import LAUNCH_ENV, REPO_ROOT, is_torchrun, launch

from tandemrl.inference.server_auth import TOKEN_ENV

LAUNCH = [sys.executable, "-m", "tandemrl.launchers.local"]
ENV = LAUNCH_ENV
SFT_STEPS = 6


def _example(name: str, model_key: str, model: str, data: str, root: Path, *extra: str) -> list[str]:
    """``examples/<name>.py --config examples/<name>.yaml`` on the tiny model and local GSM8K."""
    paths = (f"{model_key}={model}", f"train_dataset.path={data}", f"cluster.fileroot={root}")
    return [f"examples/{name}.py", "--config", f"examples/{name}.yaml", *paths, *extra]


def _sft_args(model: str, data: str, root: Path, *extra: str) -> list[str]:
    return _example(
        "gsm8k_sft",
        "model.path",
        model,
        data,
        root,
        "train_dataset.max_samples=256",
        "train_dataset.batch_size=8",
        f"total_train_steps={SFT_STEPS}",
        "saver.freq_steps=2",
        "evaluator.freq_steps=1000",
        "recover.mode=auto",
        "recover.freq_steps=1",
        "stats_logger.wandb.mode=disabled",
        *extra,
    )


def _endless_grpo(model: str, data: str, root: Path, *extra: str) -> list[str]:
    """The GRPO example for 1000 steps (a test stops it), short generations, no saves or evaluation."""
    return _example(
        "gsm8k_grpo",
        "actor.engine.path",
        model,
        data,
        root,
        "total_train_steps=1000",
        "gconfig.max_new_tokens=16",
        "evaluator.freq_steps=1000",
        "saver.freq_steps=1000",
        "stats_logger.wandb.mode=disabled",
        *extra,
    )


def _launch(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return launch(args, timeout)


def _losses(tb_dir: Path, tag: str = "sft/loss") -> dict[int, float]:
    """step -> the value written last (a resumed run re-logs the steps after its checkpoint)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    events = []
    for file in tb_dir.glob("events.out.tfevents.*"):
        for ev in EventFileLoader(str(file)).Load():
            for v in ev.summary.value:
                if v.tag == tag:
                    events.append((ev.wall_time, ev.step, float(tensor_util.make_ndarray(v.tensor).item())))
    return {step: value for _, step, value in sorted(events)}


def _family(launcher: psutil.Process) -> list[psutil.Process]:
    return [launcher, *launcher.children(recursive=True)]


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _dead(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _read_to_the_end(proc: subprocess.Popen[str]) -> tuple[list[str], threading.Thread]:
    """The lines of ``proc``'s output as a thread reads them, and that thread (see :func:`_all_of`)."""
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout or []), daemon=True)
    reader.start()
    return out, reader


def _all_of(out: list[str], reader: threading.Thread) -> str:
    """The whole output once the process has ended: the reader has reached its end (the pipe closed)."""
    reader.join(60)
    assert not reader.is_alive(), "the launcher's output did not end"
    return "".join(out)


def _wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"launcher exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


def _files_written_after(root: Path, t_ns: int, skip: set[str]) -> list[str]:
    late = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if name in skip:
                continue
            try:
                if path.lstat().st_mtime_ns > t_ns:
                    late.append(f"{path} (+{(path.lstat().st_mtime_ns - t_ns) / 1e9:.3f}s)")
            except FileNotFoundError:
                continue
    return late


def _assert_hf_checkpoints_load(ckpt_root: Path) -> list[str]:
    """Every checkpoint under its final name loads in transformers; returns their names."""
    from transformers import AutoModelForCausalLM

    names = sorted(p.name for p in ckpt_root.glob("epoch*globalstep*") if not p.name.endswith(".tmp"))
    for name in names:
        assert AutoModelForCausalLM.from_pretrained(ckpt_root / name).config.vocab_size > 0, name
    return names


@pytest.mark.slow
def test_torchrun_alone_killed_then_auto_resume_is_bitwise(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    """SIGKILL of torchrun only: every rank is gone at once and writes nothing after. Then a shard of the
    newest recoverable checkpoint is truncated: the same command with ``recover.mode=auto`` names the file,
    resumes from the previous checkpoint, and the per-step losses equal an uninterrupted run's bit for bit
    (data order, optimizer and LR schedule restored)."""
    ref_root, root = tmp_path / "reference", tmp_path / "killed"
    ref = _launch(_sft_args(tiny_model_dir, gsm8k_dir, ref_root))
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    expected = _losses(ref_root / "tensorboard" / "gsm8k-sft" / "trial0")
    assert sorted(expected) == list(range(SFT_STEPS))

    args = _sft_args(tiny_model_dir, gsm8k_dir, root)
    proc = subprocess.Popen(
        LAUNCH + args, cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out, reader = _read_to_the_end(proc)
    launcher = psutil.Process(proc.pid)
    state = root / "checkpoints" / "gsm8k-sft" / "trial0" / "recover" / "loop_state.json"
    try:
        # The kill lands after the recoverable checkpoint of step 2, somewhere in steps 3-6.
        _wait_for(lambda: '"global_step": 1' in (state.read_text() if state.exists() else ""), 600, "step 2", proc)
        family = _family(launcher)
        torchrun = [p for p in family if is_torchrun(_cmd(p)) and "lifeline" not in _cmd(p)]
        assert len(torchrun) == 1, [_cmd(p) for p in family]
        ranks = torchrun[0].children()
        assert len(ranks) == 2 and all("gsm8k_sft.py" in _cmd(r) for r in ranks), [_cmd(r) for r in ranks]
        torchrun[0].send_signal(signal.SIGKILL)
        _wait_for(lambda: _dead(torchrun[0]), 60, "torchrun to die")
        t_dead = time.time_ns()
        start = time.monotonic()
        gone, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"ranks outlived torchrun: {[_cmd(p) for p in alive]}"
        rc = proc.wait(timeout=120)
    finally:
        for p in _family(launcher) if proc.poll() is None else []:
            p.kill()
    rank_exit_s = time.monotonic() - start
    assert rc != 0
    text = _all_of(out, reader)
    assert "[launcher] trial trial0 failed: trainer was killed by SIGKILL" in text, text[-3000:]
    # No rank wrote anything once its torchrun was gone (trainer.log is the launcher's copy of their output).
    late = _files_written_after(root, t_dead, skip={"trainer.log"})
    assert not late, late
    ckpts = root / "checkpoints" / "gsm8k-sft" / "trial0"
    assert _assert_hf_checkpoints_load(ckpts)

    # The newest recoverable checkpoint is damaged too (a shard cut short): the resumed run names the file
    # in one line and resumes from the previous checkpoint, one step earlier, with the same losses.
    recover = ckpts / "recover"
    shard = sorted((recover / "engines" / "model").glob("*.distcp"))[0]
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    resumed = _launch(args)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    log = (root / "logs" / "gsm8k-sft" / "trial0" / "trainer.log").read_text()
    fallback = (
        f"recover: checkpoint {recover} is corrupt: {shard}: {size // 2} bytes, {size} were written; "
        f"resuming from the previous one, {recover}.prev"
    )
    assert fallback in log and f"recover: resumed from {recover}.prev after" in log, log[-3000:]
    got = _losses(root / "tensorboard" / "gsm8k-sft" / "trial0")
    assert got == expected  # exact float equality, every step
    assert _assert_hf_checkpoints_load(ckpts) == _assert_hf_checkpoints_load(
        ref_root / "checkpoints" / "gsm8k-sft" / "trial0"
    )
    print(f"ranks gone {rank_exit_s:.2f}s after torchrun")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting the small tmpfs needs root")
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path
) -> None:
    """The trial's checkpoint directory is a tmpfs with room for step 1's recoverable checkpoint (about 3x the
    model: weights and Adam states) and the final HF model, not for step 2's recoverable checkpoint: the save
    fails with ENOSPC, the launcher's last lines name the path and the errno, and step 1's checkpoint is intact."""
    from tandemrl.trainers.manifest import check_manifest

    model = sum(f.stat().st_size for f in Path(tiny_model_dir).glob("*.safetensors"))
    ckpts = tmp_path / "checkpoints" / "gsm8k-sft" / "trial0"
    ckpts.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(model * 4.5)}", "tmpfs", str(ckpts)], check=True)
    try:
        args = _sft_args(tiny_model_dir, gsm8k_dir, tmp_path, "allocation_mode=fsdp:d1", "saver.freq_steps=1000")
        proc = _launch([a if not a.startswith("total_train_steps=") else "total_train_steps=2" for a in args])
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
        lines = proc.stdout.strip().splitlines()
        assert lines[-2] == (
            "[launcher] trial trial0 failed: trainer rank 0: CheckpointWriteError: recover: cannot write checkpoint "
            f"to {ckpts}/recover.tmp: No space left on device (ENOSPC)"
        ), lines[-6:]
        check_manifest(str(ckpts / "recover"))  # step 1's recoverable checkpoint, whole
        assert '"global_step": 0' in (ckpts / "recover" / "loop_state.json").read_text()
    finally:
        subprocess.run(["umount", str(ckpts)], check=False)


# ------------------------------------------------------------------ ports and bound addresses


def _listening(port: int) -> set[str]:
    return {
        c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port
    }


def test_weight_update_group_listens_on_loopback_only_and_a_busy_port_is_one_line() -> None:
    """torch's TCPStore listens on every interface; the weight-update group's store must not."""
    import torch
    from utils import free_port

    from tandemrl.weights.group import destroy_group, host_group, join_group

    port = free_port()
    box: dict[str, object] = {}
    head = threading.Thread(target=lambda: box.update(pg=host_group("127.0.0.1", port, 2, "gloo", 60)))
    head.start()
    server_side = join_group("127.0.0.1", port, 2, 1, "gloo", 60)
    head.join(timeout=60)
    try:
        assert _listening(port) == {"127.0.0.1"}
        t = torch.zeros(3)
        box["pg"].broadcast(torch.arange(3.0), 0)  # type: ignore[attr-defined]
        server_side.broadcast(t, 0).wait()
        assert t.tolist() == [0.0, 1.0, 2.0]
    finally:
        destroy_group(server_side)
        destroy_group(box.get("pg"))  # type: ignore[arg-type]

    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = busy.getsockname()[1]
        with pytest.raises(OSError) as e:  # the bind error itself: no peer wait, no 60 s timeout in between
            host_group("127.0.0.1", taken, 2, "gloo", 60)
    assert str(e.value) == f"[Errno 98] weight-update group: cannot listen on 127.0.0.1:{taken}: Address already in use"


@pytest.mark.slow
def test_launcher_sigkilled_leaves_nothing_and_servers_listen_on_loopback(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path
) -> None:
    """A GRPO run's vLLM server (API process and engine core), torchrun's rendezvous store and the rank
    listen on 127.0.0.1 only; after SIGKILL of the launcher itself, the server group, torchrun and its rank
    all end."""
    args = _endless_grpo(tiny_model_dir, gsm8k_dir, tmp_path)
    proc = subprocess.Popen(
        LAUNCH + args, cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    launcher = psutil.Process(proc.pid)
    family: list[psutil.Process] = []
    try:
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # type: ignore[union-attr]
        # The server is healthy once the launcher has started torchrun, which forks the rank.
        _wait_for(lambda: any("gsm8k_grpo.py" in _cmd(p) for p in torchrun_children(launcher)), 900, "the rank", proc)
        family = _family(launcher)
        servers = [p for p in family if "vllm" in _cmd(p).lower()]  # API server, engine core (VLLM::EngineCore)
        assert servers, [_cmd(p) for p in family]
        bound = {(c.laddr.ip, _cmd(p)[:80]) for p in servers for c in p.net_connections("tcp") if c.status == "LISTEN"}
        assert bound and {ip for ip, _ in bound} == {"127.0.0.1"}, bound
        print(f"server processes {[_cmd(p)[:40] for p in servers]} listen on {bound}")
        # The census of every process of the run: servers, torchrun (its rendezvous store) and the rank.
        census = {(c.laddr.ip, _cmd(p)[:80]) for p in family for c in _listening_sockets(p)}
        assert any(is_torchrun(cmd) for _, cmd in census), census  # torchrun's store is counted...
        assert {ip for ip, _ in census} == {"127.0.0.1"}, census  # ...and nothing listens beyond loopback
        launcher.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        start = time.monotonic()
        _, alive = psutil.wait_procs(family[1:], timeout=120)
        print(f"everything gone {time.monotonic() - start:.1f}s after the launcher")
        assert not alive, [_cmd(p) for p in alive]
    finally:
        for p in family:
            if not _dead(p):
                p.kill()


def _listening_sockets(p: psutil.Process) -> list:  # noqa: ANN401 (psutil's pconn)
    try:
        return [c for c in p.net_connections("tcp") if c.status == "LISTEN"]
    except psutil.Error:
        return []


def torchrun_children(launcher: psutil.Process) -> list[psutil.Process]:
    return [c for p in _family(launcher) if is_torchrun(_cmd(p)) and "lifeline" not in _cmd(p) for c in p.children()]


@pytest.mark.slow
def test_a_sigstopped_server_is_reported_then_stops_the_run(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path
) -> None:
    """The GRPO run's vLLM server is SIGSTOPped once training started: the launcher reports it once after
    launcher.server_stall_warn, stops the run after launcher.server_stall_limit naming it, and leaves no process."""
    args = _endless_grpo(
        tiny_model_dir, gsm8k_dir, tmp_path, "launcher.server_stall_warn=3", "launcher.server_stall_limit=12"
    )
    proc = subprocess.Popen(
        LAUNCH + args, cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out, reader = _read_to_the_end(proc)
    launcher = psutil.Process(proc.pid)
    family: list[psutil.Process] = []
    try:
        _wait_for(lambda: any("gsm8k_grpo.py" in _cmd(p) for p in torchrun_children(launcher)), 900, "the rank", proc)
        family = _family(launcher)
        leader = next(p for p in family if "vllm.entrypoints" in _cmd(p) and os.getpgid(p.pid) == p.pid)
        os.killpg(leader.pid, signal.SIGSTOP)
        rc = proc.wait(timeout=300)
    finally:
        for p in family:
            if not _dead(p):
                p.kill()
    text = _all_of(out, reader)  # all of it: a second report of the stall would be in its last lines
    assert rc == 1, text[-3000:]
    healthy = "[launcher] vllm servers healthy at "
    address = next(line for line in out if line.startswith(healthy))[len(healthy) :].strip()
    assert text.count(f"[launcher] vllm server {address} has not answered for ") == 1, text[-3000:]
    failed = [line for line in text.splitlines() if line.startswith("[launcher] trial trial0 failed: ")]
    assert failed and failed[0].startswith(f"[launcher] trial trial0 failed: vllm server {address} has not answered"), (
        text[-3000:]
    )
    _, alive = psutil.wait_procs(family[1:], timeout=60)
    assert not alive, [_cmd(p) for p in alive]


# ------------------------------------------------------------------ inference servers lost mid-run


class _Sleeper:
    """A stand-in server process for ``wait_trainer``: a real child that runs until killed."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


class _Silent(_Sleeper):
    """A stand-in server that lives but never answers its health route (like a SIGSTOPped one)."""

    def is_answering(self, timeout: float = 5.0) -> bool:
        return False


class _Answering(_Sleeper):
    def is_answering(self, timeout: float = 5.0) -> bool:
        return True


def test_a_server_that_stops_answering_is_reported_once_then_stops_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Of two live servers, the one that never answers is reported once (which, since when, what waits on it),
    then the run stops with it as the cause; the answering one is never named."""
    from tandemrl.launchers.server_watch import StallBounds, wait_trainer

    trainer = _Sleeper("trainer")
    servers = [_Answering("127.0.0.1:1001"), _Silent("127.0.0.1:1002")]
    stopped: list[int] = []
    try:
        rc, error = wait_trainer(
            trainer.proc, servers, "vllm", True, lambda: stopped.append(1), stalls=StallBounds(warn=1.0, limit=3.0)
        )
    finally:
        for p in (trainer, *servers):
            p.proc.kill()
            p.proc.wait()
    assert rc == 1 and stopped == [1]
    assert error is not None and error.startswith("vllm server 127.0.0.1:1002 has not answered for ")
    assert error.endswith("s (launcher.server_stall_limit): stopped")
    warned = [line for line in capsys.readouterr().out.splitlines() if "has not answered" in line]
    assert len(warned) == 1 and warned[0].startswith("[launcher] vllm server 127.0.0.1:1002 has not answered for ")
    assert "the trainer's generation requests and weight updates wait on it" in warned[0]


def test_collective_run_stops_at_once_when_one_of_two_servers_dies() -> None:
    """A collective weight-update group needs every server: one death stops the trainer at once,
    with one line naming the server; with disk updates the same death only prints a line."""
    from tandemrl.launchers.server_watch import wait_trainer

    for survivable in (False, True):
        trainer = _Sleeper("trainer")
        servers = [_Sleeper("127.0.0.1:1001"), _Sleeper("127.0.0.1:1002")]
        stopped: list[int] = []

        def stop(t: _Sleeper = trainer, calls: list[int] = stopped) -> None:
            calls.append(1)
            t.proc.kill()

        try:
            servers[1].proc.kill()
            if survivable:  # the trainer then ends by itself; the run's result is its exit code
                threading.Thread(target=lambda t=trainer, s=servers[1]: (s.proc.wait(), t.proc.terminate())).start()
            rc, error = wait_trainer(trainer.proc, servers, "vllm", survivable, stop)
        finally:
            for p in (trainer, *servers):
                p.proc.kill()
                p.proc.wait()
        if survivable:
            assert (rc, error, stopped) == (-signal.SIGTERM, None, [])
        else:
            assert rc == 1 and stopped == [1]
            assert error == (
                "vllm server 127.0.0.1:1002 was killed by SIGKILL: weight_update_mode=collective needs every server"
            )


class _Crashing:
    """A stand-in server whose process dies of an exception, its traceback in its log, like a vLLM worker's."""

    def __init__(self, address: str, log_file: Path) -> None:
        self.address = address
        self.log_file = str(log_file)
        code = "import sys; print('INFO serving'); raise RuntimeError('CPU Generator does not use offset')"
        with open(log_file, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)


def test_the_summary_says_what_a_server_crash_was(tmp_path: Path) -> None:
    """The run's one-line error names the exception the dead server's log holds, not only its exit code."""
    from tandemrl.launchers.server_watch import wait_trainer

    trainer = _Sleeper("trainer")
    server = _Crashing("127.0.0.1:1003", tmp_path / "vllm-server-0.log")
    try:
        rc, error = wait_trainer(trainer.proc, [server], "vllm", True, trainer.proc.kill)
    finally:
        for p in (trainer, server):
            p.proc.kill()
            p.proc.wait()
    assert rc == 1 and error == (
        "vllm server 127.0.0.1:1003 exited with 1 (RuntimeError: CPU Generator does not use offset): no server is left"
    )


def test_a_bad_server_flag_is_named_on_the_failure_line(tmp_path: Path, tiny_model_dir: str) -> None:
    """A flag vLLM does not know: the first line of the error (all a launcher prints) quotes vLLM's own refusal."""
    from tandemrl.inference.server import ServerError, launch_server
    from tandemrl.inference.vllm import VLLMBackend

    server = launch_server(VLLMBackend(), tiny_model_dir, extra={"no_such_flag": 1}, log_file=str(tmp_path / "v.log"))
    try:
        with pytest.raises(ServerError) as err:
            server.wait_healthy(timeout=300)
    finally:
        server.stop()
    first = str(err.value).splitlines()[0]
    assert first.startswith("vllm server on 127.0.0.1:") and "exited with code 2 before it was healthy: " in first
    assert "error: unrecognized arguments: --no-such-flag" in first, first


def _grpo_disk_args(model: str, data: str, root: Path) -> list[str]:
    return _example(
        "gsm8k_grpo",
        "actor.engine.path",
        model,
        data,
        root,
        "allocation_mode=vllm:d2+fsdp:d1",
        "weight_update_mode=disk",
        "total_train_steps=1000",
        "gconfig.max_new_tokens=8",
        "saver.freq_steps=1",
        "evaluator.freq_steps=1000",
        "stats_logger.wandb.mode=disabled",
    )


def _weight_loads(log: Path) -> int:
    return log.read_text(errors="replace").count('"POST /collective_rpc HTTP/1.1" 200')


@pytest.mark.slow
def test_grpo_goes_on_with_one_of_two_servers_then_fails_in_one_line(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path
) -> None:
    """Two vLLM servers, disk weight updates. SIGKILL of one server's process group after step 1:
    the next steps roll out on and push weights to the survivor only. SIGKILL of the survivor
    after step 3: the launcher stops the run at once, its last lines name the dead server, and
    every checkpoint loads in transformers."""
    proc = subprocess.Popen(
        LAUNCH + _grpo_disk_args(tiny_model_dir, gsm8k_dir, tmp_path),
        cwd=REPO_ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
    launcher = psutil.Process(proc.pid)
    ckpts = tmp_path / "checkpoints" / "gsm8k-grpo" / "trial0"
    logs = tmp_path / "logs" / "gsm8k-grpo" / "trial0"
    healthy = "[launcher] vllm servers healthy at "
    try:
        _wait_for(lambda: (ckpts / "epoch0epochstep0globalstep0").is_dir(), 900, "step 1's checkpoint", proc)
        addrs = next(line for line in out if line.startswith(healthy))[len(healthy) :].strip().split(",")
        # Each server runs under its own lifeline process, the leader of its process group.
        leaders = [p for p in launcher.children() if "vllm.entrypoints" in _cmd(p) and os.getpgid(p.pid) == p.pid]
        assert len(leaders) == 2 == len(addrs), [_cmd(p) for p in leaders]
        by_addr = {a: p for a in addrs for p in leaders if f"--port {a.rsplit(':', 1)[1]} " in _cmd(p)}
        (gone, survivor), survivor_log = addrs, logs / "vllm-server-1.log"
        token = by_addr[survivor].environ()[TOKEN_ENV]
        assert requests.post(f"http://{survivor}/pause?mode=abort", timeout=30).status_code == 401
        os.killpg(by_addr[gone].pid, signal.SIGKILL)
        loads_at_kill = _weight_loads(survivor_log)
        _wait_for(lambda: (ckpts / "epoch0epochstep2globalstep2").is_dir(), 600, "step 3's checkpoint", proc)
        assert _weight_loads(survivor_log) >= loads_at_kill + 2  # the updates after steps 1 and 2
        family = _family(launcher)
        os.killpg(by_addr[survivor].pid, signal.SIGKILL)
        start = time.monotonic()
        rc = proc.wait(timeout=120)
        stopped_s = time.monotonic() - start
    finally:
        for p in _family(launcher) if proc.poll() is None else []:
            p.kill()
    text = "".join(out)
    assert rc == 1, text[-3000:]
    assert f"[launcher] vllm server {gone} was killed by SIGKILL; 1 of 2 servers left" in text
    assert f"inference server {gone} marked dead" in text  # the trainer's client failed over
    lines = text.strip().splitlines()
    assert lines[-2] == (
        f"[launcher] trial trial0 failed: vllm server {gone} was killed by SIGKILL; "
        f"vllm server {survivor} was killed by SIGKILL: no server is left"
    ), lines[-5:]
    assert lines[-1].startswith("[launcher] full output: ")
    assert token not in text and not [f for f in logs.rglob("*") if f.is_file() and token in f.read_text("latin-1")]
    assert "globalstep2" in " ".join(_assert_hf_checkpoints_load(ckpts))
    _, alive = psutil.wait_procs(family[1:], timeout=60)
    assert not alive, [_cmd(p) for p in alive]
    print(f"run stopped {stopped_s:.1f}s after the last server died")

"""The local launcher: GRPO end to end with a real vLLM server, sweeps, teardown, early errors."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from utils import LAUNCH_ENV, REPO_ROOT, is_torchrun, launch
from vllm_server import RunningServer, VLLMTestServer, load_noisy_weights

LAUNCHER = "tandemrl.launchers.local"
LAUNCH = [sys.executable, "-m", LAUNCHER]
ENV = LAUNCH_ENV


def _scalars(tb_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _run(
    args: list[str], timeout: float, launcher: str = LAUNCHER, server: RunningServer | None = None
) -> subprocess.CompletedProcess[str]:
    """Launch ``args``; with ``server`` (the ``running_server`` fixture) on that running server, none started."""
    return launch(args, timeout, launcher=launcher, server=server)


def _grpo_args(script: str, model: str, data: str, root: Path, steps: int, new_tokens: int) -> list[str]:
    """A short GRPO run on GSM8K: SCRIPT, the example config and overrides (evaluates at the end; the final
    model is saved whatever the save frequency, saver.save_final)."""
    return [
        script,
        "--config",
        "examples/gsm8k_grpo.yaml",
        f"actor.engine.path={model}",
        f"train_dataset.path={data}",
        f"cluster.fileroot={root}",
        f"total_train_steps={steps}",
        "rollout.max_head_offpolicyness=1",
        "valid_dataset.max_samples=8",
        f"gconfig.max_new_tokens={new_tokens}",
        f"evaluator.freq_steps={steps}",
    ]


# docs/metrics.md: logged at every step of every RL run.
PIPELINE_KEYS = {
    "pipeline/trainer_idle",
    "pipeline/server_idle",
    "pipeline/weight_sync",
    "pipeline/staleness/avg",
    "pipeline/staleness/max",
    "rollout/in_flight",
    "rollout/env_wait",
    "rollout/staleness/max",
    "rollout/reward",
}


@pytest.mark.slow
def test_grpo_gsm8k_dp2_sync_and_async_on_fsdp(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path, running_server: RunningServer
) -> None:
    """``vllm:d1+fsdp:d2``, 3 steps per ``async_training=false,true`` trial (one launch): each DP rank's client
    rolls out its own prompts and groups are dealt whole (``_grpo_dp2``); held-out accuracy before and after,
    quiet output, the metrics contract, stats.jsonl, curves and the final model, which vLLM reloads."""
    heldout = ["heldout_eval.n=6", "heldout_eval.max_new_tokens=8"]
    fsdp = ["allocation_mode=vllm:d1+fsdp:d2", *heldout]
    trials, proc = _grpo_dp2(fsdp, tiny_model_dir, gsm8k_dir, tmp_path, steps=3, server=running_server)
    # Both trials ran on the session's server (the second after the first had trained it: _grpo_dp2's sync
    # trial checks are on-policy from version 0 on).
    assert proc.stdout.count("[launcher] vllm servers not started here (rollout.server_addrs): ") == 2
    assert len(trials) == 2
    # Held-out accuracy before the first step (version 0) and after the last (version 3), both trials.
    assert proc.stdout.count("held-out greedy accuracy on test[:6] (gsm8k): ") == 2, proc.stdout[-3000:]
    assert proc.stdout.count(" questions, exact McNemar p=") == 2, proc.stdout[-3000:]
    # Quiet by default (tandemrl.utils.quiet): no library progress bars or known-harmless warnings.
    for noise in ("set_vital", "Loading weights", "examples/s]", "Generating train split"):
        assert noise not in proc.stdout + proc.stderr, noise
    keys: dict[str, list[set[str]]] = {}  # trial -> each step's stats.jsonl keys
    for trial in ("trial0_async_trainingfalse", "trial0_async_trainingtrue"):
        reports = [
            json.loads((tmp_path / "logs" / "gsm8k-grpo" / trial / f"heldout_{t}.json").read_text())
            for t in ("before", "after")
        ]
        assert [(r["tag"], r["version"], r["n"], r["indices"]) for r in reports] == [
            ("before", 0, 6, list(range(6))),
            ("after", 3, 6, list(range(6))),
        ]
        assert all(len(q["generated"]) > 0 and q["gold"] for r in reports for q in r["questions"])
        stats = trials[trial]
        # Versions advance: after the first update the server produces tokens of newer versions.
        assert stats["rollout_version_max"][-1] >= 1
        assert stats["rollout_version_max"] == sorted(stats["rollout_version_max"])
        # stats.jsonl mirrors the committed steps; curves.png is drawn from it at the end.
        log_dir = tmp_path / "logs" / "gsm8k-grpo" / trial
        from tandemrl.trainers.plots import read_stats

        rows = read_stats(str(log_dir / "stats.jsonl"))
        assert sorted(rows) == [1, 2, 3] and [rows[s]["rollout/reward"] for s in (1, 2, 3)] == pytest.approx(
            stats["rollout/reward"], rel=1e-6
        )
        assert "eval-rollout/accuracy" in rows[3], sorted(rows[3])
        keys[trial] = [set(rows[s]) for s in (1, 2, 3)]
        # Steps with no learning signal (every advantage 0, or a zero gradient), read from stats.jsonl, are
        # counted on the closing line (the tiny model rarely earns a reward, so most steps have none).
        adv, grad = "actor/ppo_actor/advantages/", "actor/ppo_actor/update/grad_norm"
        flat = [s for s in (1, 2, 3) if rows[s][adv + "min"] == rows[s][adv + "max"] == 0 or rows[s][grad] == 0]
        clause = f"; {len(flat)} of 3 steps carried no learning signal ("
        assert (clause in proc.stdout) if flat else ("steps carried no learning signal" not in proc.stdout), clause
        assert all(PIPELINE_KEYS <= k for k in keys[trial]), PIPELINE_KEYS - set.intersection(*keys[trial])
        assert (log_dir / "curves.png").stat().st_size > 0 and str(log_dir / "curves.png") in proc.stdout
        ckpt = tmp_path / "checkpoints" / "gsm8k-grpo" / trial / "epoch0epochstep2globalstep2"
        final = f"final model (HF format, loadable by transformers and vLLM): {ckpt}"
        assert final in proc.stdout
        # The trial's last line names the final model: the curves' path comes before it.
        assert proc.stdout.index(str(log_dir / "curves.png")) < proc.stdout.index(final), proc.stdout[-3000:]
    # The metrics contract (docs/metrics.md): a sync and an async run log the same keys at every step.
    sync, async_ = keys["trial0_async_trainingfalse"], keys["trial0_async_trainingtrue"]
    assert sync == async_, [sorted(a ^ b) for a, b in zip(sync, async_, strict=True)]
    # The final model reloads in vLLM: a fresh server on the sync trial's checkpoint continues 3 prompts
    # greedily exactly as transformers does (fp32 on both sides).
    _served_greedy_equals_transformers(
        tmp_path / "checkpoints" / "gsm8k-grpo" / "trial0_async_trainingfalse" / "epoch0epochstep2globalstep2",
        tmp_path / "vllm-final.log",
    )


def _served_greedy_equals_transformers(ckpt: Path, log: Path) -> None:
    from vllm_server import VLLMTestServer, assert_greedy_matches, decisive_prompt, launch_test_server, load_hf

    model = load_hf(str(ckpt))
    refs = [decisive_prompt(model, 8, seed) for seed in (1, 2, 3)]
    proc = launch_test_server(str(ckpt), str(log), dtype="float32")
    try:
        proc.wait_healthy(900.0)
        server = VLLMTestServer(proc, str(ckpt), 0.0)
        for ref in refs:
            assert_greedy_matches(server.generate(ref.prompt, 8), ref)
    finally:
        proc.stop()


def _two_async_grpo_steps(
    backend_args: list[str], model: str, data: str, tmp_path: Path, launcher: str = LAUNCHER
) -> str:
    """2 async GRPO steps (staleness bound 1) on a training backend / launcher; returns the trainer log.

    Checks what every backend and launcher must give: two updates and two weight pushes,
    the staleness bound, an eval reward, and a step-1 checkpoint that transformers loads.
    """
    args = _grpo_args("examples/gsm8k_grpo.py", model, data, tmp_path, steps=2, new_tokens=32)
    proc = _run([*args, *backend_args, "async_training=true"], timeout=1200, launcher=launcher)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    stats = _scalars(tmp_path / "tensorboard" / "gsm8k-grpo" / "trial0")
    assert len(stats["actor/ppo_actor/update/loss"]) == 2 and len(stats["timeperf/update_weights"]) == 2, sorted(stats)
    # Bounded staleness over the weight updates (the trainer is at version s at step s).
    lags = [s - v for s, v in enumerate(stats["rollout_version_min"])]
    assert len(lags) == 2 and 0 <= min(lags) and max(lags) <= 1, lags
    assert max(stats["rollout/staleness/max"]) <= 1
    assert "eval-rollout/reward" in stats
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "checkpoints" / "gsm8k-grpo" / "trial0" / "epoch0epochstep1globalstep1"
    assert AutoModelForCausalLM.from_pretrained(ckpt).config.vocab_size > 0
    return (tmp_path / "logs" / "gsm8k-grpo" / "trial0" / "trainer.log").read_text()


PROBE = "tests/workers/grpo_dp_probe.py"  # the GRPO example, also recording each rank's batch


def _check_dp_batches(probe_dir: Path, steps: int, batch_size: int, group_size: int) -> None:
    """Both DP ranks trained every step, each on its own whole groups, together on the step's whole batch."""
    records = [json.loads(line) for f in sorted(probe_dir.glob("rank*.jsonl")) for line in f.read_text().splitlines()]
    assert sorted((r["step"], r["dp_rank"]) for r in records) == [(s, d) for s in range(steps) for d in (0, 1)]
    for step in range(steps):
        mine = {r["dp_rank"]: r for r in records if r["step"] == step}
        groups: dict[int, list[tuple[int, ...]]] = {}
        for dp_rank, r in mine.items():
            assert r["dp_world"] == 2 and r["version"] == step, r | {"prompts": "..."}
            rows = [tuple(p) for p in r["prompts"]]
            assert rows and len(rows) % group_size == 0, (step, dp_rank, len(rows))
            chunks = [rows[i : i + group_size] for i in range(0, len(rows), group_size)]
            assert all(len(set(c)) == 1 for c in chunks), f"step {step} rank {dp_rank}: a group was split"
            groups[dp_rank] = [c[0] for c in chunks]
        # Different groups on the two ranks, and the step's prompts (each rank's client drew its own
        # share of the dataset) all arrived exactly once.
        assert not set(groups[0]) & set(groups[1]), f"step {step}: both ranks trained the same group"
        everything = groups[0] + groups[1]
        assert len(everything) == len(set(everything)) == batch_size, (step, [len(g) for g in groups.values()])


def _check_no_waste_and_profile(stats: dict[str, list[float]], trainer_log: Path, trial: str, steps: int) -> None:
    """No logprob recompute ran (one optimizer step per batch with the default correction: the
    update's own forward is the proximal policy, on- or off-policy), no reference forward ran (KL
    off), every phase of a step was timed, and the run ended with its time split."""
    assert stats["actor/recompute_skipped"] == [1.0] * steps, (trial, stats["actor/recompute_skipped"])
    assert "timeperf/actor/recompute_logp" not in stats, trial
    assert "timeperf/ref_logp" not in stats, trial
    phases = ["rollout_wait", "update_weights", "save", "eval", "recover", "step"]
    phases += [f"actor/ppo_actor/update/{p}" for p in ("fwd_bwd", "optimizer_step")]
    for phase in phases:
        assert len(stats[f"timeperf/{phase}"]) == steps and min(stats[f"timeperf/{phase}"]) >= 0.0, (trial, phase)
    # The servers' busy time: the first step waited for its whole batch to be generated.
    busy = stats["rollout/timeperf/server_busy"]
    assert len(busy) == steps and busy[0] > 0.0 and min(busy) >= 0.0, (trial, busy)
    split = [line for line in trainer_log.read_text().splitlines() if "grpo time split: " in line]
    assert len(split) == 1, (trial, split)
    for label in ("rollout wait (trainer idle) ", "fwd+bwd ", "optimizer ", "weight sync ", "save/eval ", "other "):
        assert label in split[0], (trial, split[0])
    trainer_part, server_part = split[0].split("time split: ")[1].split("; server idle ")
    shares = [int(part.rsplit(" ", 1)[1].rstrip("%")) for part in trainer_part.split(" | ")]
    assert abs(sum(shares) - 100) <= len(shares), (trial, split[0])  # shares of the steps' time, rounded
    assert 0 <= int(server_part.rstrip("%")) < 100, (trial, split[0])


def _grpo_dp2(
    backend_args: list[str],
    model: str,
    data: str,
    tmp_path: Path,
    sweep: tuple[str, ...] = ("--multirun",),
    steps: int = 2,
    server: RunningServer | None = None,
) -> tuple[dict[str, dict[str, list[float]]], subprocess.CompletedProcess[str]]:
    """STEPS GRPO steps per trial on 2 data-parallel trainer ranks, by default one trial per
    ``async_training=false,true``; returns each trial's tensorboard scalars by trial name, and the launch.

    Checks for every trial: the DP batches (``_check_dp_batches``), an update and a weight push per step,
    the staleness bound (sync: on-policy; async: 1), an eval reward and a final checkpoint transformers loads.
    """
    args = _grpo_args(PROBE, model, data, tmp_path, steps=steps, new_tokens=16)
    modes = ["async_training=false,true"] if sweep == ("--multirun",) else []
    proc = _run([*args, "train_dataset.max_samples=64", *sweep, *modes, *backend_args], timeout=1800, server=server)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    trials = {}
    for probe_dir in sorted((tmp_path / "dp_probe").iterdir()):
        trial = probe_dir.name
        _check_dp_batches(probe_dir, steps=steps, batch_size=8, group_size=4)
        stats = _scalars(tmp_path / "tensorboard" / "gsm8k-grpo" / trial)
        updates, pushes = stats["actor/ppo_actor/update/loss"], stats["timeperf/update_weights"]
        assert len(updates) == steps and len(pushes) == steps, trial
        config = (tmp_path / "logs" / "gsm8k-grpo" / trial / "config.yaml").read_text()
        bound = 1 if "async_training: true" in config else 0
        lags = [s - v for s, v in enumerate(stats["rollout_version_min"])]
        assert len(lags) == steps and min(lags) >= 0 and max(lags) <= bound, (trial, lags)
        if bound:
            assert max(stats["rollout/staleness/max"]) <= bound, trial
        else:  # on-policy: step s's tokens came from the weights the trainer pushed to the server after step s - 1
            assert stats["rollout_version_min"] == list(range(steps)), (trial, stats["rollout_version_min"])
        assert "eval-rollout/reward" in stats, trial
        trainer_log = tmp_path / "logs" / "gsm8k-grpo" / trial / "trainer.log"
        _check_no_waste_and_profile(stats, trainer_log, trial, steps)
        from transformers import AutoModelForCausalLM

        last = steps - 1
        ckpt = tmp_path / "checkpoints" / "gsm8k-grpo" / trial / f"epoch0epochstep{last}globalstep{last}"
        assert AutoModelForCausalLM.from_pretrained(ckpt).config.vocab_size > 0
        trials[trial] = stats
    return trials, proc


@pytest.mark.slow
def test_grpo_dp2_sync_and_async_on_deepspeed(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path, running_server: RunningServer
) -> None:
    """``vllm:d1+deepspeed:d2``: sync on ZeRO-2, async on ZeRO-3, both with a user's DeepSpeed JSON."""
    ds_json = tmp_path / "ds_config.json"  # the engine owns these two: it warns and uses its own values
    ds_json.write_text(json.dumps({"gradient_clipping": 5.0, "zero_optimization": {"stage": 1}}))
    backend = ["allocation_mode=vllm:d1+deepspeed:d2", f"actor.engine.deepspeed.config_path={ds_json}"]
    for stage, mode in ((2, "false"), (3, "true")):
        run = [
            *backend,
            f"actor.engine.deepspeed.zero_stage={stage}",
            f"async_training={mode}",
            f"trial_name=zero{stage}",
        ]
        root = tmp_path / f"zero{stage}"
        trials, _ = _grpo_dp2(run, tiny_model_dir, gsm8k_dir, root, sweep=(), server=running_server)
        assert list(trials) == [f"zero{stage}"]
        log = (tmp_path / f"zero{stage}" / "logs" / "gsm8k-grpo" / f"zero{stage}" / "trainer.log").read_text()
        # The DeepSpeed engine trained on this stage: it read the user's JSON and overrode the keys it owns.
        assert "deepspeed config: 'gradient_clipping' is set by the engine" in log, log[-3000:]
        assert f"zero_optimization.stage comes from deepspeed.zero_stage={stage}" in log, log[-3000:]


@pytest.mark.slow
def test_grpo_dp2_async_on_megatron(
    tiny_model_dir: str,
    gsm8k_dir: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    running_server: RunningServer,
) -> None:
    """``vllm:d1+megatron:d2``, async: two DP replicas of one rank each, both heads of their replica. (The DP
    dealing of rollouts is the rollout layer's, run sync and async on FSDP2 and DeepSpeed above.)"""
    # Verbose: Megatron's own start-up notices, which the quiet default hides, show that it trained.
    monkeypatch.setitem(ENV, "TANDEMRL_VERBOSE", "1")
    run = ["allocation_mode=vllm:d1+megatron:d2", "async_training=true", "trial_name=async"]
    trials, _ = _grpo_dp2(run, tiny_model_dir, gsm8k_dir, tmp_path, sweep=(), server=running_server)
    assert list(trials) == ["async"]
    for trial in trials:
        assert "megatron" in (tmp_path / "logs" / "gsm8k-grpo" / trial / "trainer.log").read_text()


@pytest.mark.slow
def test_sft_multirun_sweep_makes_separate_trials(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    proc = _run(
        [
            "examples/gsm8k_sft.py",
            "--config",
            "examples/gsm8k_sft.yaml",
            "--multirun",
            "model.optimizer.lr=1e-3,3e-3",
            f"model.path={tiny_model_dir}",
            f"train_dataset.path={gsm8k_dir}",
            "train_dataset.max_samples=256",
            f"cluster.fileroot={tmp_path}",
            "total_train_steps=3",
            "saver.freq_steps=100",
            "evaluator.freq_steps=100",
        ],
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    trials = sorted(p.name for p in (tmp_path / "logs" / "gsm8k-sft").iterdir())
    assert trials == ["trial0_lr1e-3", "trial0_lr3e-3"]
    for t in trials:
        assert len(_scalars(tmp_path / "tensorboard" / "gsm8k-sft" / t)["sft/loss"]) == 3
        assert (tmp_path / "logs" / "gsm8k-sft" / t / "trainer.log").stat().st_size > 0
    assert "trial0_lr1e-3" in proc.stdout and "ok" in proc.stdout.splitlines()[-1]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("allocation_mode=vllm:d1+fsdp:d1p2", "fsdp does not support pipeline parallel"),
        ("actor.engine.path=/no/such/model", "actor.engine.path: model directory not found: /no/such/model"),
        (
            "allocation_mode=vllm:d1|fsdp:d1",
            "'async_training' in the schema defaults must be false when allocation_mode",
        ),
        ("allocation_mode='vllm[gen]:d1+vllm[judge]:d1+fsdp[actor]:d1'", "'aux_servers.judge.path' is not set"),
        (
            "train_dataset.reasoning_gym.tasks=[chain_summ]",
            "train_dataset.reasoning_gym.tasks[0].name: 'chain_summ' is not a reasoning-gym task (close: chain_sum",
        ),
        (
            "rollout.server_addrs=[127.0.0.1:1] launcher.server_args.max_num_seqs=4",
            "rollout.server_addrs names running servers, so the server flags ['max_num_seqs']",
        ),
    ],
)
def test_bad_input_fails_before_any_process(override: str, expected: str, tmp_path: Path) -> None:
    proc = _run(
        [
            "examples/gsm8k_grpo.py",
            "--config",
            "examples/gsm8k_grpo.yaml",
            f"cluster.fileroot={tmp_path}",
            *override.split(),
        ],
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    # Nothing was started: no server or trainer announced, no run directory created.
    assert "[launcher]" not in proc.stdout
    assert not any(tmp_path.iterdir())


def _is_worker(p: psutil.Process) -> bool:
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return False
    return "gsm8k_grpo.py" in cmd and not is_torchrun(cmd)


@pytest.mark.slow
def test_killing_the_trainer_leaves_no_process(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        LAUNCH
        + [
            "examples/gsm8k_grpo.py",
            "--config",
            "examples/gsm8k_grpo.yaml",
            f"actor.engine.path={tiny_model_dir}",
            f"train_dataset.path={gsm8k_dir}",
            f"cluster.fileroot={tmp_path}",
            "total_train_steps=1000",
            "gconfig.max_new_tokens=16",  # a first step soon: short generations, no evaluation, no wandb
            "evaluator.freq_steps=1000",
            "stats_logger.wandb.mode=disabled",
        ],
        cwd=REPO_ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    me = psutil.Process(proc.pid)
    for line in proc.stdout:  # the servers are healthy and the trainer has been started
        if "[launcher] trainer:" in line:
            break
    else:
        pytest.fail("launcher ended before starting the trainer")
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining its output
    deadline = time.monotonic() + 300
    workers: list[psutil.Process] = []
    while not workers and time.monotonic() < deadline:
        time.sleep(2)
        workers = [p for p in me.children(recursive=True) if _is_worker(p)]
    assert workers, "no trainer worker process appeared"
    tb_dir = tmp_path / "tensorboard" / "gsm8k-grpo" / "trial0"
    while time.monotonic() < deadline + 600:  # into training: the first step's stats are logged
        if tb_dir.is_dir() and "actor/ppo_actor/update/loss" in _scalars(tb_dir):
            break
        time.sleep(1)
    else:
        pytest.fail("the trainer logged no training step")
    family = me.children(recursive=True)
    assert any("vllm" in " ".join(p.cmdline()) for p in family)
    for w in workers:  # the trainer dies mid-run
        w.send_signal(signal.SIGKILL)
    rc = proc.wait(timeout=180)
    assert rc != 0
    gone, alive = psutil.wait_procs(family, timeout=60)
    assert not alive, [p.cmdline() for p in alive]


# One truncating and one masking correction (each kind's weights are checked against hand values in
# tests/unit/test_offpolicy.py); the launch shows each one acting on a real run's mismatch.
OFFPOLICY = ("tis", "icepop")


@pytest.mark.slow
def test_grpo_async_offpolicy_corrections_log_mismatch(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path, running_server: RunningServer, vllm_server: VLLMTestServer
) -> None:
    """2 async GRPO steps on FSDP2 per mismatch correction (one launch, a --multirun sweep); each logs the
    trainer/server mismatch, what its correction dropped or truncated, and the staleness of every step.

    The trials run on a running server (``rollout.server_addrs``) that holds other weights when the launch
    starts (the first trial: the tiny model plus noise; the second: the first trial's last push). Each
    trainer installs its own initial weights first, so step 0's tokens match the trainer's forward: mean
    |dlogp| 0.0008-0.001 measured; without that push the first trial's was 0.49.
    """
    load_noisy_weights(vllm_server, tmp_path / "noisy")
    args = _grpo_args("examples/gsm8k_grpo.py", tiny_model_dir, gsm8k_dir, tmp_path, steps=2, new_tokens=16)
    # C = 1.001: the bf16 trainer's gap to the server (|dlogp| ~ 1e-3) makes every correction act.
    sweep = ["--multirun", f"actor.offpolicy_correction={','.join(OFFPOLICY)}", "actor.offpolicy_cap=1.001"]
    launch = [*args, "async_training=true", "train_dataset.batch_size=2", *sweep]
    proc = _run(launch, timeout=2400, server=running_server)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count("[launcher] vllm servers not started here (rollout.server_addrs): ") == 2
    mm, sv = "actor/ppo_actor/update/offpolicy/", "actor/ppo_actor/offpolicy/"
    for kind in OFFPOLICY:
        trial = f"trial0_offpolicy_correction{kind}"
        config = (tmp_path / "logs" / "gsm8k-grpo" / trial / "config.yaml").read_text()
        assert f"offpolicy_correction: {kind}" in config, trial
        stats = _scalars(tmp_path / "tensorboard" / "gsm8k-grpo" / trial)
        loss = stats["actor/ppo_actor/update/loss"]
        assert len(loss) == 2 and all(math.isfinite(x) for x in loss), (trial, loss)
        keys = ["abs_dlogp/avg", "abs_dlogp/max", "kl_k3", "masked", "truncated"]
        got = {k: stats[mm + k] for k in keys}
        got |= {k: stats[sv + k] for k in ("version_lag/min", "version_lag/avg", "version_lag/max")}
        got["multi_version_tokens"] = stats[sv + "multi_version_tokens"]
        assert all(len(v) == 2 for v in got.values()), (trial, got)
        # bf16 trainer vs the server: a small, non-zero gap on the same tokens.
        assert all(0.0 < a <= m < 5.0 for a, m in zip(got["abs_dlogp/avg"], got["abs_dlogp/max"], strict=True))
        # Step 0's tokens came from the trainer's own initial weights, pushed over the server's noisy ones.
        assert got["abs_dlogp/avg"][0] < 0.01, (trial, got["abs_dlogp/avg"])
        assert all(k >= 0.0 for k in got["kl_k3"]), (trial, got["kl_k3"])
        fractions = got["masked"] + got["truncated"] + got["multi_version_tokens"]
        assert all(0.0 <= f <= 1.0 for f in fractions), (trial, got)
        # Truncating corrections cut some weights and never drop a token; masking ones the other way round.
        acted, idle = ("truncated", "masked") if kind in ("tis", "cispo") else ("masked", "truncated")
        assert sum(got[acted]) > 0.0 and got[idle] == [0.0, 0.0], (trial, got)
        kept = stats["actor/ppo_actor/update/behav_kept_ratio/avg"]
        assert [1.0 - k for k in kept] == pytest.approx(got["masked"]), (trial, kept, got["masked"])
        # Step 0 is on-policy: no recompute, the mismatch came from the training forward itself.
        assert stats["actor/recompute_skipped"][0] == 1.0, (trial, stats["actor/recompute_skipped"])
        # Staleness bound 1; step 0 trains on the initial weights' samples.
        assert got["version_lag/max"][0] == 0.0 and max(got["version_lag/max"]) <= 1.0, (trial, got)
        lags = zip(got["version_lag/min"], got["version_lag/avg"], got["version_lag/max"], strict=True)
        assert all(lo <= a <= hi for lo, a, hi in lags), (trial, got)

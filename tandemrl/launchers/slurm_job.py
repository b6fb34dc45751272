"""A submitted Slurm job from the submitter's side: ``sbatch``, follow it to its end, say why it failed.

``python -m tandemrl.launchers.slurm ... --wait`` submits the job, prints its state changes, and
returns when the job has ended (its processes are gone: Slurm's COMPLETING is not the end). A job
that did not complete gives one line: the step the job script recorded as failed (in
``RUN_DIR/job-<id>.failed``: step, what happened, its log), with a trainer rank's first error
when torchrun recorded one; else the job's final state and its ``slurm-<id>.out``. Ctrl-C or
SIGTERM while waiting cancels the job (``scancel``) and waits for it to end.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from tandemrl.launchers.common import LaunchError, TrialResult, first_rank_error, guarded_trial
from tandemrl.launchers.launch_config import LaunchSpec

FAILED_FILE = "job-{job}.failed"  # under the run dir, written by the job script's fail()
# States of a job that has ended (squeue/scontrol names); every other state is waited through.
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
ENDED |= {"OUT_OF_MEMORY"}
POLL_S = 2.0
QUERY_ERRORS_S = 300.0  # give up when scontrol has failed for this long in a row


def _tool(name: str, job: Path | None = None) -> str:
    path = shutil.which(name)
    if path is None:
        where = f"submit {job} on a Slurm login node, or use --dry-run" if job else "is Slurm installed?"
        raise LaunchError(f"{name} not found on PATH: {where}")
    return path


def submit(job: Path) -> str:
    """``sbatch --parsable JOB``; returns the job id."""
    proc = subprocess.run([_tool("sbatch", job), "--parsable", str(job)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise LaunchError(f"sbatch {job} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[:300]}")
    return proc.stdout.strip().split(";")[0]  # "ID" or "ID;CLUSTER"


def job_state(job_id: str) -> tuple[str, str] | None:
    """(state, exit code) from ``scontrol show job``; None once Slurm no longer knows the job.

    Raises LaunchError when scontrol fails for another reason (the controller is unreachable).
    """
    proc = subprocess.run([_tool("scontrol"), "show", "job", "-o", job_id], capture_output=True, text=True)
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return None
        raise LaunchError(f"scontrol show job {job_id}: {(proc.stderr or proc.stdout).strip()[:300]}")
    fields = dict(f.split("=", 1) for f in proc.stdout.split() if "=" in f)
    return fields.get("JobState", "UNKNOWN"), fields.get("ExitCode", "?")


def wait_job(job_id: str, poll: float = POLL_S) -> tuple[str, str]:
    """Poll until the job has ended; prints each new state. Returns its last (state, exit code)."""
    last, seen, failing_since = ("UNKNOWN", "?"), "", None
    while True:
        try:
            state = job_state(job_id)
            failing_since = None
        except LaunchError:
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since > QUERY_ERRORS_S:
                raise
            state = last
        if state is None:  # purged from the controller: it ended a while ago
            return last if last[0] in ENDED else ("ENDED", last[1])
        last = state
        if state[0] != seen:
            seen = state[0]
            print(f"[launcher] job {job_id} {seen}", flush=True)
        if state[0] in ENDED:
            return state
        time.sleep(poll)


def failure(job_id: str, state: str, exit_code: str, run_dir: Path, since_ns: int) -> str:
    """One line: the failed step and its log (from the job script), else the job's state and output."""
    failed = run_dir / FAILED_FILE.format(job=job_id)
    try:
        step, what, log = failed.read_text().rstrip("\n").split("\t", 2)
    except (OSError, ValueError):
        return f"job {job_id} {state} (exit code {exit_code}; log: {run_dir / f'slurm-{job_id}.out'})"
    rank = first_rank_error(run_dir, since_ns) if step == "trainer" else None
    detail = f": rank {rank[0]}: {rank[1]}" if rank else ""
    return f"job {job_id} {state}: {step} step {what}{detail} (log: {log})"


def cancel(job_id: str, timeout: float = 300.0) -> None:
    """``scancel`` the job and wait (bounded) until it has ended."""
    subprocess.run([_tool("scancel"), job_id], capture_output=True, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_state(job_id)
        if state is None or state[0] in ENDED:
            return
        time.sleep(POLL_S)


def run_job(job: Path, spec: LaunchSpec, overrides: list[str]) -> TrialResult:
    """Submit ``job``, wait for its end; a failure is one line. Interrupted: the job is cancelled."""
    submitted: list[str] = []
    ended: list[bool] = []

    def body(run_dir: Path) -> tuple[int, str]:
        since = time.time_ns()
        job_id = submit(job)
        submitted.append(job_id)
        print(f"[launcher] Submitted batch job {job_id}", flush=True)
        state, exit_code = wait_job(job_id)
        ended.append(True)
        if state == "COMPLETED":
            return 0, ""
        return 1, failure(job_id, state, exit_code, run_dir, since)

    def teardown() -> None:
        if submitted and not ended:
            print(f"[launcher] cancelling job {submitted[0]}", flush=True)
            cancel(submitted[0])

    return guarded_trial(spec, overrides, body, teardown)

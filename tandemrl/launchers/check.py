"""Check a training script's config and inputs without running it.

    python -m tandemrl.launchers.check SCRIPT --config YAML [key=value ...]

Runs SCRIPT as ``__main__`` with ``TANDEMRL_CHECK_ONLY=1``: the script's ``load_config`` builds
and validates its config against the script's own schema, then checks the model paths and
dataset files it names (``tandemrl.configs.checks.check_inputs``) and stops the script there.
Exit status: 0 all good; 2 a bad config or input (one ``error:`` line on stderr, printed by the
script's entry point); :data:`NOT_CHECKED` the script ended without building a config with
``load_config`` (or failed before it did), so nothing could be checked. The launchers call this before starting anything;
with ``TANDEMRL_DRY_RUN_REPORT`` naming a file, a good config's ``--dry-run`` report is written there
(``tandemrl.launchers.dry_run``).
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

from tandemrl.configs.checks import CHECK_ONLY_ENV, InputsChecked, configs_seen
from tandemrl.launchers.dry_run import REPORT_ENV, config_report
from tandemrl.launchers.launch_config import LaunchError, script_config

NOT_CHECKED = 3
CHECK_TIMEOUT = 600.0


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tandemrl.launchers.check SCRIPT [--config YAML] [overrides]", file=sys.stderr)
        return 2
    os.environ[CHECK_ONLY_ENV] = "1"
    script = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except InputsChecked as done:
        report = os.environ.get(REPORT_ENV)
        if report:
            Path(report).write_text(config_report(done.config), encoding="utf-8")
        return 0
    except BaseException:
        if configs_seen[0]:  # the config or an input is bad: the script's entry point said why
            raise
    return NOT_CHECKED


def check_script(script: str, config_path: str | None, overrides: list[str], report: str | None = None) -> bool:
    """Run the check in a fresh process; False if the script does not use ``load_config``.

    ``report``: a file to write the ``--dry-run`` report into (``tandemrl.launchers.dry_run``).

    A bad config or input raises ValueError with the script's one-line error. A script whose text
    never mentions ``load_config`` is not run at all: running it would do its work.
    """
    if "load_config" not in Path(script).read_text(encoding="utf-8", errors="replace"):
        return False
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_") and k != REPORT_ENV}
    if report:
        env[REPORT_ENV] = report
    with tempfile.TemporaryDirectory(prefix="tandemrl-check-") as tmp:
        config, kept = script_config(config_path, overrides, os.path.join(tmp, "config.yaml"))
        cmd = [sys.executable, "-m", "tandemrl.launchers.check", script]
        cmd += (["--config", config] if config else []) + kept
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env=env, timeout=CHECK_TIMEOUT, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            raise LaunchError(f"checking the config of {script} took over {CHECK_TIMEOUT:.0f} s") from None
    if proc.returncode == 0:
        return True
    if proc.returncode == NOT_CHECKED:
        return False
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else f"{script} exited with {proc.returncode} while checking its config"
    raise ValueError(last.removeprefix("error: "))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""``tandemrl``: one command in front of the launchers, the evaluator, the server and the benches.

    tandemrl run SCRIPT.py --config CONFIG.yaml [key=value ...]   # this machine (launchers.local)
    tandemrl ray|slurm SCRIPT.py --config CONFIG.yaml [...]      # a Ray cluster / a Slurm job
    tandemrl eval DIR [...]                                      # GSM8K accuracy of a checkpoint
    tandemrl serve --backend vllm --model DIR [...]              # one inference server
    tandemrl tinker-serve --model DIR [...]                      # the Tinker API (docs/tinker.md)
    tandemrl bench NAME [...]                                    # bench/NAME.py of this checkout

Each command runs the module named below with the remaining arguments, exactly as
``python -m <module> ...`` would: ``tandemrl COMMAND --help`` shows its options.
"""

from __future__ import annotations

import os
import runpy
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("tandemrl.launchers.local", "launch a training script on this machine"),
    "ray": ("tandemrl.launchers.ray", "launch a training script on a Ray cluster"),
    "slurm": ("tandemrl.launchers.slurm", "submit a training script as a Slurm job"),
    "eval": ("tandemrl.eval", "greedy GSM8K accuracy of an HF checkpoint through vLLM"),
    "serve": ("tandemrl.launchers.serve", "start one inference server"),
    "tinker-serve": ("tandemrl.tinker.serve", "serve the Tinker training/sampling API (docs/tinker.md)"),
    "bench": ("", "run bench/NAME.py of this checkout (tandemrl bench NAME [args])"),
}


def usage() -> str:
    lines = ["usage: tandemrl COMMAND [args...]", "", "commands:"]
    lines += [
        f"  {name:<12} {about}" + (f" (python -m {mod})" if mod else "") for name, (mod, about) in COMMANDS.items()
    ]
    lines += ["", "tandemrl COMMAND --help shows a command's options."]
    return "\n".join(lines)


def fail(message: str) -> None:
    """Bad input: one ``error:`` line on stderr, exit code 2 (like every tandemrl entry point)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def bench_path(name: str) -> str:
    """``bench/<name>.py`` next to the installed package (a checkout or an editable install)."""
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    path = os.path.join(bench, f"{name.removesuffix('.py')}.py")
    if not os.path.isfile(path):
        found = sorted(f[:-3] for f in os.listdir(bench) if f.endswith(".py")) if os.path.isdir(bench) else []
        fail(f"bench '{name}': no {path} (benches here: {', '.join(found) or 'none'})")
    return path


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        fail(f"unknown command '{command}' (one of: {', '.join(COMMANDS)})")
    module = COMMANDS[command][0]
    if command == "bench":
        if not rest:
            fail("tandemrl bench NAME [args]: give a bench name, e.g. vs_trl")
        path = bench_path(rest[0])
        sys.argv = [path, *rest[1:]]
        runpy.run_path(path, run_name="__main__")
        return
    sys.argv = [f"tandemrl {command}", *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

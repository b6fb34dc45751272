"""Quiet by default: no library progress bars or known-harmless warnings in our processes.

``quiet_process()`` runs first in every launcher and training script. It sets environment
variables (so child processes, servers and torchrun ranks inherit them) and warning filters for
output a user cannot act on: ``datasets`` Generating/Map progress bars, transformers' "Loading
weights" bar, torchdata's ``set_vital`` deprecation warning, DeepSpeed's "Setting accelerator to CPU"
notice (logged whenever transformers imports DeepSpeed on a machine without CUDA, e.g. while saving an HF
checkpoint; in-process, so each of our processes calls this), torch's collective deprecation warnings that
DeepSpeed and Megatron trigger, and Megatron's Apex/TransformerEngine fallback notices. Our own progress bar, one-line stats
and summaries stay. ``TANDEMRL_VERBOSE=1`` (``scripts/main.sh --verbose``) leaves everything on.
A variable the user set already is never overridden.
"""

from __future__ import annotations

import builtins
import logging
import os
import re
import sys
import warnings

VERBOSE_ENV = "TANDEMRL_VERBOSE"
QUIET_ENV: dict[str, str] = {
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",  # datasets: Generating split / Map / Filter bars
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' weight-loading bar follows the hub's switch
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "WANDB_SILENT": "true",  # wandb's banner and its run summary (~30 lines); the metrics are in stats.jsonl
}
# (message prefix, category) of warnings known to be harmless here.
# torch's FutureWarnings come from DeepSpeed's and Megatron's own collectives (one per rank and call site); the
# Apex/TransformerEngine notices say Megatron uses its torch fallbacks, which it does on a machine without CUDA.
# A message must hold no ',' or ':' (PYTHONWARNINGS' separators): these are prefixes.
HARMLESS_WARNINGS: tuple[tuple[str, str], ...] = (
    ("'set_vital' is deprecated", "UserWarning"),
    ("`torch.distributed.all_gather_into_tensor` is deprecated", "FutureWarning"),
    ("`torch.distributed.reduce_scatter_tensor` is deprecated", "FutureWarning"),
    ("Apex is not installed", "UserWarning"),
    ("Transformer Engine and Apex are not installed", "UserWarning"),
    ("full scope is deprecated", "UserWarning"),
)
# (logger name, message prefix) of log records known to be harmless here.
HARMLESS_LOGS: tuple[tuple[str, str], ...] = (("DeepSpeed", "Setting accelerator to CPU."),)


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes")


def _pythonwarnings() -> str:
    ours = [f"ignore:{msg}:{cat}" for msg, cat in HARMLESS_WARNINGS]
    theirs = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
    return ",".join([*theirs, *(w for w in ours if w not in theirs)])


def quiet_process() -> None:
    """Silence library noise in this process and its children, unless ``TANDEMRL_VERBOSE`` is set."""
    if verbose():
        return
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["PYTHONWARNINGS"] = _pythonwarnings()
    for msg, cat in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(msg), category=getattr(builtins, cat, Warning))
    for name, prefix in HARMLESS_LOGS:  # the logger object persists: the library's later import keeps the filter
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefix) and f.prefix == prefix for f in log.filters):
            log.addFilter(_DropPrefix(prefix))
    _switch_off_loaded_bars()


def _switch_off_loaded_bars() -> None:
    """The variables above are read when a library is imported; one imported already is told directly."""
    if "huggingface_hub" in sys.modules:  # transformers' weight-loading bar follows the hub's switch
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()

"""Names the vocabulary pass retired (one word per concept: docs/architecture.md, "Vocabulary").

An old class name imported from its old module fails with one line naming the new one, e.g.
``ImportError: RemoteInfEngine was renamed to RemoteInferenceClient in tandemrl 0.2
(tandemrl.inference.remote)``: each old module's ``__getattr__`` is :func:`retired_names`, and no alias
keeps the old name working. An old attribute of a trainer (:class:`RenamedAttribute`) fails the same way,
and so does an old config key (``tandemrl.configs.moved``). These notices go in tandemrl ``REMOVED_IN``;
after that an old name is an ordinary unknown one.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from typing import Any, NoReturn

RENAMED_IN = "0.2"  # the release after tandemrl.__version__ 0.1.0 that carries the new names
REMOVED_IN = "0.3"  # the release that drops these notices (and the moved-key lines of configs/moved.py)

# old module -> {old name: (new name, where it lives now)}
RENAMED: dict[str, dict[str, tuple[str, str]]] = {
    "tandemrl.inference.remote": {"RemoteInfEngine": ("RemoteInferenceClient", "tandemrl.inference.remote")},
    "tandemrl.configs.rollout": {"InferenceEngineConfig": ("InferenceClientConfig", "tandemrl.configs.rollout")},
    "tandemrl.configs": {"InferenceEngineConfig": ("InferenceClientConfig", "tandemrl.configs")},
    "tandemrl.api.workflow": {"GenerationEngine": ("GenerationClient", "tandemrl.api.workflow")},
    "tandemrl.api": {"GenerationEngine": ("GenerationClient", "tandemrl.api")},
    "tandemrl.workflows": {"GenerationEngine": ("GenerationClient", "tandemrl.workflows")},
    "tandemrl.algorithms.lm": {"LMEngine": ("SFTActor", "tandemrl.algorithms.sft")},
}


# old module -> its new name: importing the old one fails with moved_module_line (ModuleNotices, installed
# by ``import tandemrl``).
RENAMED_MODULES: dict[str, str] = {
    "tandemrl.inference.servers": "tandemrl.inference.server_pool",
    "tandemrl.tinker.server": "tandemrl.tinker.routes",
}


def moved_module_line(old: str, new: str) -> str:
    """The one line an import of a renamed module fails with."""
    return f"module {old} was renamed to {new} in tandemrl {RENAMED_IN}"


class ModuleNotices(importlib.abc.MetaPathFinder):
    """A finder consulted for the renamed modules alone: their import raises :func:`moved_module_line`."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name in RENAMED_MODULES:
            raise ModuleNotFoundError(moved_module_line(name, RENAMED_MODULES[name]), name=name)
        return None


def install_module_notices() -> None:
    """Put one :class:`ModuleNotices` first in ``sys.meta_path`` (again: a no-op)."""
    if not any(isinstance(f, ModuleNotices) for f in sys.meta_path):
        sys.meta_path.insert(0, ModuleNotices())


def renamed_line(old: str, new: str, where: str) -> str:
    """The one line an old name fails with."""
    return f"{old} was renamed to {new} in tandemrl {RENAMED_IN} ({where})"


def retired_names(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module``: its retired names raise :func:`renamed_line`, others the
    usual AttributeError. An ImportError (not an AttributeError), so ``from module import Old`` shows the line."""
    table = RENAMED.get(module, {})

    def __getattr__(name: str) -> Any:
        if name in table:
            new, where = table[name]
            raise ImportError(renamed_line(name, new, where), name=module)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


class RenamedAttribute:
    """A retired attribute of a class: reading it on an instance raises the one line naming the new one."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.old = self.owner = self.module = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.old, self.owner, self.module = name, owner.__name__, owner.__module__

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        if obj is None:  # the class itself (introspection), not a user's read
            return self
        return self.fail()

    def fail(self) -> NoReturn:
        raise AttributeError(renamed_line(f"{self.owner}.{self.old}", f"{self.owner}.{self.new}", self.module))


__all__ = [
    "REMOVED_IN",
    "RENAMED",
    "RENAMED_IN",
    "RENAMED_MODULES",
    "ModuleNotices",
    "RenamedAttribute",
    "install_module_notices",
    "moved_module_line",
    "renamed_line",
    "retired_names",
]

"""Bind a backend-agnostic algorithm class to a training backend (the two-class pattern).

An algorithm such as ``LMEngine(engine)`` or ``PPOActor(config, engine)`` is written only
against :class:`~tandemrl.api.engine.TrainEngine`. ``@binds(LMEngine, attr="lm")`` on a
subclass of a backend engine adds ``self.lm`` (built on first use) and exposes each public
method of the algorithm on the engine with the algorithm's own signature and docstring,
so ``FSDPLMEngine(config).train_lm(batch)`` works without hand-written forwarding.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

E = TypeVar("E", bound=type)


def _build(algo_cls: type, engine: Any) -> Any:
    params = list(inspect.signature(algo_cls).parameters)
    if params and params[0] == "config":
        return algo_cls(engine.config, engine)
    return algo_cls(engine)


def _forwarder(attr: str, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(self, attr), name)(*args, **kwargs)

    return method


def binds(algo_cls: type, attr: str) -> Callable[[E], E]:
    """Class decorator: attach ``algo_cls`` to an engine subclass as ``attr``."""

    def decorate(engine_cls: E) -> E:
        slot = f"_{attr}_instance"

        def get(self: Any) -> Any:
            inst = self.__dict__.get(slot)
            if inst is None:
                inst = _build(algo_cls, self)
                self.__dict__[slot] = inst
            return inst

        setattr(engine_cls, attr, property(get, doc=f"The bound {algo_cls.__name__}."))
        for name, func in inspect.getmembers(algo_cls, inspect.isfunction):
            if name.startswith("_") or name in engine_cls.__dict__:
                continue
            if hasattr(engine_cls, name):
                raise TypeError(f"{algo_cls.__name__}.{name} would shadow {engine_cls.__name__}.{name}")
            setattr(engine_cls, name, _forwarder(attr, name, func))
        return engine_cls

    return decorate

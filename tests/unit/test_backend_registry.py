"""A new inference backend is one class and one registry row: nothing else names it.

The toy backend lives in a module written to a temporary directory; that module declares the
class (with its ``parallel_dims``) and registers its row. ``allocation_mode`` parsing, the
config loader, the launcher's pre-flight and the client then all take it, with no other file
of tandemrl changed. A toy training engine does the same through the engine registry.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tandemrl.api.allocation import AllocationValidationError
from tandemrl.configs import GRPOConfig, InferenceClientConfig
from tandemrl.configs.backends import INFERENCE_ROWS, TRAINING_ROWS, parse_allocation
from tandemrl.inference.remote import RemoteInferenceClient
from tandemrl.launchers.launch_config import read_launch_spec
from tandemrl.trainers.entry import load_config

TOY_MODULE = '''
import dataclasses

from tandemrl.engines.fsdp import FSDPEngine
from tandemrl.engines.registry import register_engine
from tandemrl.inference.registry import register_backend
from tandemrl.inference.vllm import VLLMBackend


class ToyBackend(VLLMBackend):
    """A server kind that takes data and tensor parallel sizes, and answers health checks elsewhere."""

    name = "toy"
    parallel_dims = "dt"

    def build_health(self):
        return dataclasses.replace(super().build_health(), path="/toy_health")


class ToyEngine(FSDPEngine):
    """A training backend that takes data parallel sizes only."""

    backend = "toytrain"
    parallel_dims = "d"


register_backend("toy", __name__ + ":ToyBackend")
register_engine("toytrain", ToyEngine)
'''


@pytest.fixture
def toy(tmp_path: Path) -> Iterator[ModuleType]:
    """The toy module, imported from a temporary directory; its rows are removed afterwards."""
    (tmp_path / "toy_backend_module.py").write_text(textwrap.dedent(TOY_MODULE), encoding="utf-8")
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module("toy_backend_module")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("toy_backend_module", None)
        INFERENCE_ROWS.pop("toy", None)
        TRAINING_ROWS.pop("toytrain", None)


def test_allocation_mode_takes_the_toy_backends_with_their_declared_dims(toy: ModuleType) -> None:
    alloc = parse_allocation("toy:d2t2+fsdp:d4")
    assert alloc.gen is not None and alloc.gen.backend == "toy" and alloc.gen.kind == "inference"
    assert (alloc.gen.strategy.dp, alloc.gen.strategy.tp) == (2, 2)
    assert parse_allocation(str(alloc)) == alloc
    trains = parse_allocation("vllm:d1+toytrain:d2")
    assert trains.train is not None and (trains.train.backend, trains.train.kind) == ("toytrain", "training")
    # The dims each class declares are the ones the parser allows.
    with pytest.raises(AllocationValidationError, match=r"toy does not support pipeline parallel 'p2'"):
        parse_allocation("toy:d1p2+fsdp:d1")
    with pytest.raises(AllocationValidationError, match=r"toytrain does not support tensor parallel 't2'"):
        parse_allocation("vllm:d1+toytrain:d1t2")


def test_loader_launcher_and_client_take_the_toy_backend(toy: ModuleType, tmp_path: Path) -> None:
    config, _ = load_config(["allocation_mode=toy:d1+fsdp:d1", "actor.engine.path=/none"], GRPOConfig)
    alloc = config.allocation
    assert alloc.gen_backend == "toy"

    spec = read_launch_spec(
        None,
        [
            "allocation_mode=toy:d1+fsdp:d1",
            f"cluster.fileroot={tmp_path}",
            "launcher.server_args.max_num_seqs=4",
        ],
    )
    assert spec.allocation.gen_backend == "toy" and spec.server_extra == {"max_num_seqs": 4}

    client = RemoteInferenceClient.for_backend(alloc.gen_backend, InferenceClientConfig(setup_timeout=5.0))
    assert isinstance(client.backend, toy.ToyBackend)
    assert client.backend.build_health().path == "/toy_health"


def test_unregistered_backend_is_named_with_the_registered_ones() -> None:
    with pytest.raises(AllocationValidationError, match=r"unknown backend 'toy' in 'toy:d1'; expected one of .*'vllm'"):
        parse_allocation("toy:d1+fsdp:d1")
    with pytest.raises(ValueError, match=r"unknown inference backend 'toy'"):
        RemoteInferenceClient.for_backend("toy", InferenceClientConfig())

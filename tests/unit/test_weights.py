"""The weight flow's package (tandemrl.weights): the collective update plan, and its place in the layers."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_inference_backends import assert_one_line_error

from tandemrl.configs.backends import parse_allocation
from tandemrl.weights.plan import collective_update


@pytest.mark.parametrize(
    "spec, world_size",
    [("vllm:d2t2+fsdp:d4", 5), ("sglang:d4+fsdp:d4", 5), ("vllm:d1+fsdp:d1", 2), ("vllm:d2p2+megatron:d2p2", 5)],
)
def test_collective_update_world_size(spec: str, world_size: int) -> None:
    meta = collective_update(parse_allocation(spec), group_addr="10.1.2.3", group_port=4567)
    assert (meta.type, meta.world_size, meta.group_addr, meta.group_port) == (
        "collective",
        world_size,
        "10.1.2.3",
        4567,
    )
    assert meta.path is None and meta.version is None


def test_collective_update_defaults_pick_port_and_backend() -> None:
    import torch

    meta = collective_update(parse_allocation("vllm:d1+fsdp:d1"))
    assert 0 < meta.group_port < 65536 and meta.group_addr
    assert meta.comm_backend == ("nccl" if torch.cuda.is_available() else "gloo")


def test_collective_update_needs_an_inference_component() -> None:
    with pytest.raises(ValueError) as exc:
        collective_update(parse_allocation("fsdp:d2"))
    assert_one_line_error(exc, "no inference component")


def test_weights_modules_load_only_api_and_utils() -> None:
    """Importing every module of tandemrl.weights loads no other tandemrl package (the vLLM worker imports them)."""
    code = (
        "import pkgutil, sys, tandemrl.weights as w\n"
        "names = [m.name for m in pkgutil.iter_modules(w.__path__, 'tandemrl.weights.')]\n"
        "for n in names: __import__(n)\n"
        "allowed = ('tandemrl', 'tandemrl.api', 'tandemrl.utils', 'tandemrl.weights')\n"
        "print(sorted(names))\n"
        "print(sorted(m for m in sys.modules if m.startswith('tandemrl') and '.'.join(m.split('.')[:2]) not in allowed))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == str(sorted(f"tandemrl.weights.{m}" for m in ("delta", "group", "plan", "push", "wire"))), out
    assert out[1] == "[]", out

"""``tandemrl.engines.adapter_bank``: adapters of different ranks and targets on one padded LoRA model, trained
in turns, equal the same adapters trained alone, each on its own model of its own rank with its own AdamW."""

from __future__ import annotations

import copy

import torch
from torch import nn

from tandemrl.configs.engine import LoRAConfig
from tandemrl.engines.adapter_bank import AdapterBank
from tandemrl.engines.lora import PEFT_PREFIX, LoRALinear, apply_lora

ALPHA = 32.0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(6, 6)
        self.up_proj = nn.Linear(6, 10)
        self.down_proj = nn.Linear(10, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.q_proj(x))
        return self.down_proj(torch.relu(self.up_proj(h)))


def _lora(base: nn.Module, rank: int, targets: list[str]) -> nn.Module:
    model = copy.deepcopy(base)
    apply_lora(model, LoRAConfig(rank=rank, alpha=ALPHA, target_modules=targets))
    return model


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    ((model(x) - y) ** 2).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_adapters_trained_in_turns_equal_each_trained_alone_at_its_own_rank() -> None:
    torch.manual_seed(0)
    base = Block()
    x, ya, yb = torch.randn(5, 6), torch.randn(5, 6), torch.randn(5, 6)
    specs = {"a": (2, ("q_proj",), ya), "b": (4, ("q_proj", "up_proj", "down_proj"), yb)}
    padded = _lora(base, 4, ["q_proj", "up_proj", "down_proj"])
    params = [p for p in padded.parameters() if p.requires_grad]
    bank = AdapterBank(padded, torch.optim.AdamW(params, lr=0.05, weight_decay=0.1))
    alone: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    for seed, (name, (rank, targets, _)) in enumerate(specs.items()):
        bank.add(name, rank, ALPHA, targets, seed)
        own = _lora(base, rank, list(targets))
        with torch.no_grad():  # the same initial adapter: its first `rank` rows of A, B zero
            for mod_name, mod in own.named_modules():
                if isinstance(mod, LoRALinear):
                    mod.lora_A.weight.copy_(bank.adapters[name].local[f"{mod_name}.lora_A.weight"][:rank])
        own_params = [p for p in own.parameters() if p.requires_grad]
        alone[name] = (own, torch.optim.AdamW(own_params, lr=0.05, weight_decay=0.1))
    for _ in range(3):
        for name, (_, _, y) in specs.items():
            bank.activate(name)
            _step(padded, bank.optimizer, x, y)
            _step(*alone[name], x, y)
    for name, (rank, targets, _) in specs.items():
        own, _ = alone[name]
        expected = {PEFT_PREFIX + k: v for k, v in own.state_dict().items() if ".lora_" in k}
        got = bank.peft_tensors(name)
        assert got.keys() == expected.keys() and len(got) == 2 * len(targets)
        assert float(got[f"{PEFT_PREFIX}q_proj.lora_B.weight"].abs().max()) > 1e-2  # training moved it
        for key, t in expected.items():
            torch.testing.assert_close(got[key], t, atol=1e-6, rtol=1e-5, msg=key)
        bank.activate(name)
        a = padded.get_submodule("q_proj").lora_A.weight
        assert float(a.detach()[rank:].abs().sum()) == 0.0  # the padding rows stayed zero
        torch.testing.assert_close(padded(x), own(x), atol=1e-5, rtol=1e-5)


def test_optimizer_state_and_tensors_round_trip_into_a_new_adapter() -> None:
    torch.manual_seed(1)
    model = _lora(Block(), 4, ["q_proj", "up_proj", "down_proj"])
    bank = AdapterBank(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05))
    x, y = torch.randn(5, 6), torch.randn(5, 6)
    bank.add("a", 3, ALPHA, ("q_proj", "up_proj", "down_proj"), 0)
    bank.activate("a")
    _step(model, bank.optimizer, x, y)
    tensors = {k.removeprefix(PEFT_PREFIX): v for k, v in bank.peft_tensors("a").items()}
    state = bank.optimizer_state("a")
    bank.add("copy", 3, ALPHA, ("q_proj", "up_proj", "down_proj"), 9)
    bank.load_tensors("copy", tensors)
    bank.load_optimizer_state("copy", state)
    for name in ("a", "copy"):  # one more identical step each
        bank.activate(name)
        _step(model, bank.optimizer, x, y)
    a, c = bank.peft_tensors("a"), bank.peft_tensors("copy")
    for key, t in a.items():
        torch.testing.assert_close(c[key], t, atol=0, rtol=0, msg=key)

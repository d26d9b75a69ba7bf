"""Module names in a diagnosis are the user's: a forward hook belongs to the module it is
registered on, and no wrapper (Fabric, DDP, torch.compile) adds a level to a name."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nanguard as ng
from nanguard.zoo.spawn import spawn_ranks


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.wte(ids)).pow(2).mean()


def _log_hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return torch.log(output)  # an embedding holds negative values: NaN made inside the hook


IDS = torch.arange(6).reshape(2, 3)


def test_ops_in_a_forward_hook_belong_to_the_module_it_is_registered_on() -> None:
    model = Tiny()
    model.wte.register_forward_hook(_log_hook)
    diag = ng.locate(lambda: model(IDS).backward(), model=model)
    assert diag is not None
    assert (diag.cause, diag.op, diag.module, diag.phase) == ("op.log_domain", "aten.log.default", "wte", "forward")


def test_a_hook_on_the_root_and_one_on_a_child_each_keep_their_module() -> None:
    model = Tiny()
    seen: list[str | None] = []
    model.head.register_forward_hook(lambda m, a, out: out * 1.0)  # a harmless hook on another module
    model.wte.register_forward_hook(_log_hook)
    model.register_forward_hook(lambda m, a, out: seen.append("root") or out)
    diag = ng.locate(lambda: model(IDS).backward(), model=model)
    assert diag is not None and diag.module == "wte" and seen == ["root"]


def _fault_model() -> nn.Module:
    model = Tiny()
    with torch.no_grad():
        model.head.bias.fill_(float("nan"))
    return model


def _names(diag: ng.Diagnosis) -> list[str]:
    origin = diag.evidence.get("origin") or {}
    return [n for n in (diag.module, origin.get("path"), *diag.evidence.get("bad_parameters", [])) if n]


def test_no_fabric_level_in_names() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1)
    user = Tiny()
    user.wte.register_forward_hook(_log_hook)
    model = fabric.setup_module(user)
    diag = ng.locate(lambda: model(IDS).backward(), model=model)
    assert diag is not None and diag.module == "wte", diag
    faulty = fabric.setup_module(_fault_model())
    diag = ng.locate(lambda: faulty(IDS).backward(), model=faulty)
    assert diag is not None and diag.cause == "parameters.nonfinite"
    assert "head" in diag.module and not any("_forward_module" in n or "_original_module" in n for n in _names(diag))


def test_no_compile_level_in_names() -> None:
    user = Tiny()
    user.wte.register_forward_hook(_log_hook)
    compiled = torch.compile(user, backend="eager")
    diag = ng.locate(lambda: compiled(IDS).backward(), model=compiled)
    assert diag is not None and diag.module == "wte", diag


def _ddp_names(rank: int, world: int) -> list:
    user = Tiny()
    user.wte.register_forward_hook(_log_hook)
    ddp = DDP(user)
    diag = ng.locate(lambda: ddp(IDS).backward(), model=ddp)
    return [diag.module, diag.cause]


@pytest.mark.dist
def test_no_ddp_level_in_names() -> None:
    for result in spawn_ranks(_ddp_names, world=2, timeout=120):
        assert result == ["wte", "op.log_domain"]

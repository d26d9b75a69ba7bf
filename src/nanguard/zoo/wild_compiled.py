"""Wild scenarios of a compiled submodule that miscompiles inside an eager model (see ``nanguard.zoo.wild``).

``model.head = torch.compile(model.head, backend=...)``: the rest of the model runs eagerly. The
backend (``nanguard.zoo.miscompile``, standing in for the compiler bugs users report) makes the
head's graph output NaN; the same step run eagerly is finite. ``ng.locate`` traces eagerly, so it
runs the compiled code again from the same RNG state and names the compiled submodule and its graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanguard.zoo.miscompile import miscompiling
from nanguard.zoo.scenarios import Case, Expect, WildScenario

__all__ = ["SCENARIOS"]


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(h)) * self.scale  # the graph's output is made in the head itself


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.GELU())
        self.head: nn.Module = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _compiled_head_miscompile() -> Case:
    torch.manual_seed(0)
    model = Classifier()
    model.head = torch.compile(model.head, backend=miscompiling("", lambda: True))  # type: ignore[assignment]

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return Case(fn, (torch.randn(4, 4), torch.tensor([0, 2, 1, 0])), model)


SCENARIOS = (
    WildScenario(
        "compiled_head_miscompile",
        "pytorch/pytorch#114109",
        "model.head = torch.compile(model.head, backend=...) in an eager model; the backend's head code is wrong",
        Expect("compile.numerics", None, "head", "forward", "nan"),
        "only the head is compiled and its compiled graph outputs NaN where the same graph run eagerly is finite: "
        "the compiler's numerics, in the head's forward graph",
        _compiled_head_miscompile,
    ),
)

"""Wild scenarios for causes no other wild scenario expects (see ``nanguard.zoo.wild``): weights
initialized far too large (``init.scale``), and a batch mask that emptied or corrupted a sample,
caught before the forward by ``check_batch`` (``data.fully_masked``, ``data.invalid_mask``: the
Guard's ``check_batch=True``, tested in ``tests/test_diagnosis_round4.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanguard.zoo.scenarios import Case, Expect, WildScenario

__all__ = ["SCENARIOS"]


class DeepMLP(nn.Module):
    """Sixteen float32 linear layers whose custom init passes a gain (40) as the std."""

    def __init__(self, width: int = 64, depth: int = 16) -> None:
        super().__init__()
        linears = [nn.Linear(width, width) for _ in range(depth)]
        self.layers = nn.ModuleList(linears)
        self.out = nn.Linear(width, 1)
        for layer in linears:
            nn.init.normal_(layer.weight, std=40.0)  # meant: gain 40 x 1/sqrt(fan_in) (a deep residual-free stack)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)  # no normalization: each layer multiplies the activations by ~ 40 * sqrt(64) = 320
        return self.out(x).squeeze(-1)


def _deep_mlp_gain_as_std() -> Case:
    torch.manual_seed(0)
    model = DeepMLP()

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    return Case(fn, (torch.randn(8, 64), torch.randn(8)), model)


SCENARIOS = (
    WildScenario(
        "deep_mlp_gain_as_std",
        "VinceShieh/spark-ffm#12",
        "a deep float32 MLP whose init passes a gain as the std: activations grow ~320x per layer until they overflow",
        Expect("init.scale", "aten.addmm.default", None, "forward", "inf"),
        "std 40 on a fan-in of 64 is 320x the 1/sqrt(fan_in) scale; sixteen layers without normalization grow the "
        "activations by ~320 per layer, past float32's max in a linear layer: the initialization, in float32 too",
        _deep_mlp_gain_as_std,
    ),
)

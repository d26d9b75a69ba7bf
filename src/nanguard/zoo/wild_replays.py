"""Wild scenarios whose step draws from Python's ``random`` or NumPy's global generator (see
``nanguard.zoo.wild``).

The fault is deterministic given the draw: a diffusion timestep sampler that picks the last
timestep, a masked-item objective whose random masking selects nothing. A replay that restores
only torch's generators draws other numbers and comes out finite; the replay restores the
``random`` and ``numpy.random`` global states too, so it draws what the step drew.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nanguard.zoo.scenarios import Case, Expect, WildScenario

__all__ = ["SCENARIOS", "diffusion_case", "masked_items_case"]

STEPS = 10


def _cosine_alpha_bar(steps: int) -> torch.Tensor:
    """A cosine schedule without the usual clipping: alpha_bar of the last timestep is exactly 0."""
    t = torch.arange(steps + 1, dtype=torch.float64) / steps
    f = torch.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
    alpha_bar = (f / f[0])[1:]
    alpha_bar[-1] = 0.0  # cos(pi / 2) rounds to 6e-17 in float64; the schedule's end is 0 by design
    return alpha_bar.float()


class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 16), nn.SiLU(), nn.Linear(16, 4))

    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x_t, t[:, None].float() / STEPS], -1))


class Diffusion(nn.Module):
    """An x0-parameterised loss: the denoiser's noise estimate turned into x0 by dividing by sqrt(alpha_bar_t)."""

    alpha_bar: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.denoiser = Denoiser()
        self.register_buffer("alpha_bar", _cosine_alpha_bar(STEPS))

    def forward(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        ab = self.alpha_bar[t][:, None]
        x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
        eps = self.denoiser(x_t, t)
        x0_pred = (x_t - (1 - ab).sqrt() * eps) / ab.sqrt()  # x / 0 at the last timestep
        return F.mse_loss(x0_pred, x0)


def diffusion_case(seed: int) -> Case:
    """The diffusion step, with NumPy's global generator seeded at ``seed`` (the timestep sampler draws from it)."""
    torch.manual_seed(0)
    model = Diffusion()
    np.random.seed(seed)

    def fn(x0: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        t = torch.from_numpy(np.random.choice(STEPS, size=x0.shape[0]))  # the schedule sampler's draw
        loss = model(x0, t, torch.randn_like(x0))
        loss.backward()
        return loss

    return Case(fn, (torch.randn(4, 4),), model)


class ItemEncoder(nn.Module):
    def __init__(self, items: int = 20) -> None:
        super().__init__()
        self.embed = nn.Embedding(items + 1, 8)  # the last id is [MASK]
        self.out = nn.Linear(8, items + 1)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(seq)))


def masked_items_case(seed: int) -> Case:
    """A BERT4Rec-style masked-item step with Python's ``random`` seeded at ``seed`` (it picks the masked positions)."""
    torch.manual_seed(0)
    model = ItemEncoder()
    random.seed(seed)
    mask_id, mask_prob = 20, 0.2

    def fn(seq: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        chosen = torch.tensor([[random.random() < mask_prob for _ in row] for row in seq.tolist()])
        inputs = seq.masked_fill(chosen, mask_id)
        labels = seq.masked_fill(~chosen, -100)  # only the masked positions are predicted
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())  # 0/0 when nothing was masked
        loss.backward()
        return loss

    g = torch.Generator().manual_seed(0)
    return Case(fn, (torch.randint(0, 20, (2, 3), generator=g),), model)


def _diffusion_last_timestep() -> Case:
    return diffusion_case(DIFFUSION_BAD_SEED)


def _masked_items_none_masked() -> Case:
    return masked_items_case(ITEMS_BAD_SEED)


DIFFUSION_BAD_SEED = 8  # the first draw holds the last timestep; the next two do not
ITEMS_BAD_SEED = 5  # the first draw masks no position; the next one does

SCENARIOS = (
    WildScenario(
        "diffusion_last_timestep",
        "Shark-NLP/DiffuSeq#57",
        "a diffusion loss whose timestep sampler draws with np.random.choice; the schedule's last alpha_bar is 0",
        Expect("op.division_by_zero", "aten.div.Tensor", "", "forward", "inf"),
        "when the sampler draws the last timestep, x0 = (x_t - sqrt(1 - ab) eps) / sqrt(ab) divides by "
        "sqrt(0) in the model's forward: deterministic given the draw",
        _diffusion_last_timestep,
    ),
    WildScenario(
        "masked_items_none_masked",
        "jaywonchung/BERT4Rec-VAE-Pytorch#22",
        "a masked-item objective whose positions are picked with random.random(); this step masks none",
        Expect("data.no_valid_targets", "aten.nll_loss_forward.default", None, "data", "nan"),
        "every label is -100 once random masking picked no position: the mean cross-entropy over zero targets is 0/0",
        _masked_items_none_masked,
    ),
)

"""Wild scenarios of gradient surgery on what ``torch.autograd.grad`` returned (see ``nanguard.zoo.wild``).

Multi-task methods (PCGrad, MGDA, gradient-cosine weighting) and hand-written meta-learning
updates take per-task gradients with ``torch.autograd.grad(loss, params, retain_graph=True)``:
no ``.grad`` holds them. Arithmetic on them runs outside the autograd engine and outside the
model, after the backward that made them: phase ``backward``, or ``optimizer`` where the op
writes a parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanguard.zoo.scenarios import Case, Expect, WildScenario

__all__ = ["SCENARIOS"]


class SharedTwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 6)
        self.seg = nn.Linear(6, 3)
        self.depth = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.relu(self.shared(x))
        return self.seg(z), self.depth(z).squeeze(-1)


def _flat(grads: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads])


def _pcgrad_autograd_grad_zero_task() -> Case:
    torch.manual_seed(0)
    model = SharedTwoHeads()
    shared = list(model.shared.parameters())

    def fn(x: torch.Tensor, labels: torch.Tensor, depth: torch.Tensor, has_depth: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        seg, pred = model(x)
        losses = [F.cross_entropy(seg, labels), (F.l1_loss(pred, depth, reduction="none") * has_depth).mean()]
        grads = [_flat(torch.autograd.grad(loss, shared, retain_graph=True)) for loss in losses]
        projected = []
        for i, g_i in enumerate(grads):
            for j, g_j in enumerate(grads):
                if i != j and (dot := g_i @ g_j) <= 0:  # project whenever they do not agree
                    g_i = g_i - dot * g_j / g_j.norm() ** 2  # 0/0: the depth task has no labelled pixel
            projected.append(g_i)
        merged, offset = torch.stack(projected).sum(0), 0
        for p in shared:
            p.grad = merged[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        total = losses[0] + losses[1]
        total.backward(inputs=[*model.seg.parameters(), *model.depth.parameters()])
        return total

    args = (torch.randn(5, 4), torch.tensor([0, 2, 1, 1, 0]), torch.randn(5), torch.zeros(5))
    return Case(fn, args, model)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rep = nn.Linear(4, 6)
        self.heads = nn.ModuleList([nn.Linear(6, 2), nn.Linear(6, 2)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        z = torch.tanh(self.rep(x))
        return z, [head(z) for head in self.heads]


def _mgda_identical_task_gradients() -> Case:
    torch.manual_seed(0)
    model = Encoder()
    model.heads[1].load_state_dict(model.heads[0].state_dict())  # both tasks read the same labels this batch

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        z, outs = model(x)
        losses = [F.cross_entropy(o, y) for o in outs]
        # MGDA-UB: task gradients w.r.t. the shared representation, then the two-task min-norm point.
        v1, v2 = (torch.autograd.grad(loss, z, retain_graph=True)[0].flatten() for loss in losses)
        gamma = ((v2 - v1) @ v2) / (v1 - v2).norm() ** 2  # 0/0 when the two gradients coincide
        weights = torch.stack([gamma, 1 - gamma]).detach()
        total = sum(w * loss for w, loss in zip(weights, losses, strict=True))
        total.backward()
        return total

    return Case(fn, (torch.randn(4, 4), torch.tensor([0, 1, 1, 0])), model)


class AuxNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 5)
        self.primary = nn.Linear(5, 3)
        self.aux = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.trunk(x))
        return self.primary(h), self.aux(h)


def _aux_cosine_normalize_inplace() -> Case:
    torch.manual_seed(0)
    model = AuxNet()
    trunk = [model.trunk.weight]

    def fn(x: torch.Tensor, y: torch.Tensor, y_aux: torch.Tensor, aux_on: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        out, aux = model(x)
        primary, auxiliary = F.cross_entropy(out, y), F.cross_entropy(aux, y_aux) * aux_on
        g1 = torch.autograd.grad(primary, trunk, retain_graph=True)[0].flatten()
        g2 = torch.autograd.grad(auxiliary, trunk, retain_graph=True)[0].flatten()
        g1.div_(g1.norm())
        g2.div_(g2.norm())  # the auxiliary task is off this batch: 0 / 0 in place
        cosine = g1 @ g2
        total = primary + cosine.clamp_min(0).detach() * auxiliary
        total.backward()
        return total

    args = (torch.randn(4, 4), torch.tensor([0, 1, 2, 0]), torch.tensor([1, 1, 0, 2]), torch.tensor(0.0))
    return Case(fn, args, model)


class ReZeroNet(nn.Module):
    """A residual branch gated by a scalar initialised to 0 (ReZero): the branch's weights get a zero gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.branch = nn.Linear(4, 4)
        self.alpha = nn.Parameter(torch.zeros(()))
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(h + self.alpha * self.branch(h))


def _sam_layerwise_zero_grad() -> Case:
    torch.manual_seed(0)
    model = ReZeroNet()
    params = list(model.parameters())
    rho = 0.05

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), params)
        with torch.no_grad():  # SAM's ascent step, each tensor by its own gradient norm (layer-wise)
            for p, g in zip(params, grads, strict=True):
                p.addcdiv_(g, g.norm().expand_as(g), value=rho)  # 0/0 for the gated branch
        loss = F.cross_entropy(model(x), y)  # the loss at the perturbed weights
        loss.backward()
        return loss

    return Case(fn, (torch.randn(4, 3), torch.tensor([0, 1, 1, 0])), model)


SCENARIOS = (
    WildScenario(
        "pcgrad_autograd_grad_zero_task",
        "WeiChengTseng/Pytorch-PCGrad#7",
        "PCGrad on per-task gradients from torch.autograd.grad; the depth task has no labelled pixel this batch",
        Expect("op.division_by_zero", "aten.div.Tensor", None, "backward", "nan"),
        "the depth task's gradient is all zeros, so dot = 0 <= 0 projects by dot * g_j / ||g_j||**2 = 0/0, on "
        "gradients torch.autograd.grad returned, after that backward and outside the model: phase backward",
        _pcgrad_autograd_grad_zero_task,
    ),
    WildScenario(
        "mgda_identical_task_gradients",
        "isl-org/MultiObjectiveOptimization#2",
        "MGDA-UB's two-task min-norm weight from gradients w.r.t. the shared representation (torch.autograd.grad)",
        Expect("op.division_by_zero", "aten.div.Tensor", None, "backward", "nan"),
        "the two heads are identical this batch, so v1 == v2 and ((v2 - v1) . v2) / ||v1 - v2||**2 is 0/0, "
        "computed from what torch.autograd.grad returned: phase backward",
        _mgda_identical_task_gradients,
    ),
    WildScenario(
        "aux_cosine_normalize_inplace",
        "lorenmt/maxl#8",
        "gradient cosine between a primary and an auxiliary task, normalized in place with div_",
        Expect("op.division_by_zero", "aten.div_.Tensor", None, "backward", "nan"),
        "the auxiliary loss is switched off (weight 0), so its trunk gradient is 0 and g2.div_(g2.norm()) is "
        "0/0 in place, on a gradient torch.autograd.grad returned: phase backward",
        _aux_cosine_normalize_inplace,
    ),
    WildScenario(
        "sam_layerwise_zero_grad",
        "google-deepmind/optax#1743",
        "SAM's ascent step p += rho * g / ||g|| per tensor, on torch.autograd.grad outputs, written with addcdiv_",
        Expect("op.division_by_zero", "aten.addcdiv_.default", None, "optimizer", "nan"),
        "the ReZero gate is 0, so the gated branch's gradient is all zeros and g / ||g|| is 0/0 inside addcdiv_, "
        "which writes the parameter: an update written by hand, phase optimizer",
        _sam_layerwise_zero_grad,
    ),
)

"""Wild scenarios of torch's own NaN results, gradient surgery, and NaNs that surface as a raise
(see ``nanguard.zoo.wild``).

``torch.logdet`` returns NaN by definition for a negative determinant; PCGrad and hand-written
clipping run on ``.grad`` between ``backward()`` and the optimizer step; a distribution's
``validate_args``, ``torch.multinomial`` or a loss check raise on a NaN made earlier in the step.
The distributions pass ``validate_args=True``: torch's default, which the first ``torch.compile`` in a
process turns off for the whole process (dynamo's ``TorchPatcher``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanguard.zoo.scenarios import Case, Expect, WildScenario
from nanguard.zoo.wild_losses import step

__all__ = ["SCENARIOS"]


class Invertible1x1Conv(nn.Module):
    """WaveGlow's invertible 1x1 convolution; the port dropped the line that makes det(W) positive."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c, c, 1, bias=False)
        with torch.no_grad():  # initialized to the channel reversal RealNVP uses: 3 swaps, det(W) = -1
            self.conv.weight.copy_(torch.eye(c).flip(0)[..., None])

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, _, t = z.shape
        log_det_w = b * t * torch.logdet(self.conv.weight.squeeze(-1))
        return self.conv(z), log_det_w


class FlowStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.invconv = Invertible1x1Conv(6)
        self.affine = nn.Conv1d(6, 6, 1)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        z, log_det_w = self.invconv(audio)
        z = self.affine(z)
        return (z * z).sum() / 2 - log_det_w


def _glow_invconv_negative_det() -> Case:
    torch.manual_seed(0)
    model = FlowStep()
    return Case(step(model, lambda audio: model(audio) / audio.numel()), (torch.randn(2, 6, 4),), model)


class TwoTaskNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 1, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.shared(x).sum()
        return out, -3e-5 * out  # the auxiliary task, weighted 3e-5, pulls the other way


def _project_conflicting(grads: list[torch.Tensor]) -> torch.Tensor:
    """PCGrad's projection, as in the report's repository (without the shuffle)."""
    pc_grad = [g.clone() for g in grads]
    for g_i in pc_grad:
        for g_j in grads:
            g_i_g_j = torch.dot(g_i, g_j)
            if g_i_g_j < 0:
                g_i -= g_i_g_j * g_j / (g_j.norm() ** 2)
    return torch.stack(pc_grad).mean(0)


def _pcgrad_tiny_task_gradient() -> Case:
    torch.manual_seed(0)
    model = TwoTaskNet().half()  # float16 gradients: ||g_aux||**2 ~ 4e-11 rounds to 0

    def fn(x: torch.Tensor) -> torch.Tensor:
        losses = model(x)
        grads = []
        for loss in losses:
            model.zero_grad(set_to_none=True)
            loss.backward(retain_graph=True)
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))  # type: ignore[union-attr]
        merged = _project_conflicting(grads)
        for p in model.parameters():
            p.grad = merged[: p.numel()].view_as(p).clone()
        return sum(losses)

    return Case(fn, (torch.full((1, 4), 0.1, dtype=torch.float16),), model)


class MultiHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head_cls = nn.Linear(8, 3)
        self.head_box = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        return self.head_cls(h), self.head_box(h)


def _clip_by_norm_zero_gradient() -> Case:
    torch.manual_seed(0)
    model = MultiHead()
    for p in model.parameters():  # the previous batch had boxes: every parameter has a gradient tensor
        p.grad = torch.zeros_like(p)
    max_norm = 1.0

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=False)  # gradients kept as zeros
        logits, _ = model(x)  # this batch has no boxes: head_box gets no gradient
        loss = F.cross_entropy(logits, y)
        loss.backward()
        for p in model.parameters():  # clip each gradient to max_norm by its own norm
            p.grad.mul_(max_norm / p.grad.norm())  # type: ignore[union-attr]
        return loss

    return Case(fn, (torch.randn(3, 4), torch.tensor([0, 2, 1])), model)


class PromptPolicy(nn.Module):
    """Black-box prompt learning: one categorical distribution per prompt slot, kept on the simplex by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.prompts_probs = nn.Parameter(torch.tensor([[0.2, 0.3, 0.5], [-0.1, -0.2, -0.05], [0.6, 0.2, 0.2]]))

    def forward(self) -> torch.Tensor:
        p = self.prompts_probs.clamp(min=0)  # a projected update pushed the second slot's row below 0
        return p / p.sum(-1, keepdim=True)


class PromptLearner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.policy = PromptPolicy()

    def forward(self, reward: torch.Tensor) -> torch.Tensor:
        dist = torch.distributions.Categorical(probs=self.policy(), validate_args=True)
        return -(dist.log_prob(dist.sample()) * reward).mean()


def _categorical_probs_nan() -> Case:
    torch.manual_seed(0)
    model = PromptLearner()
    return Case(step(model, model), (torch.tensor([1.0, 0.5, -0.2]),), model)


class SamplingLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lm_head = nn.Linear(8, 10, bias=False)
        with torch.no_grad():  # a fine-tuned model whose logits outgrew float16
            self.emb.weight.fill_(30.0)
            self.lm_head.weight.fill_(300.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.emb(ids)[:, -1])  # 8 * 30 * 300 = 72000 > 65504
        probs = torch.softmax(logits.float(), dim=-1)
        next_token = torch.multinomial(probs, 1)
        return torch.log(probs.gather(1, next_token)).mean()  # REINFORCE on the sampled token


def _multinomial_fp16_logits() -> Case:
    torch.manual_seed(0)
    model = SamplingLM().half()
    return Case(step(model, lambda ids: -model(ids)), (torch.tensor([[1, 2, 3]]),), model)


class GaussianHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, var = self.fc(h).chunk(2, dim=-1)
        return mu, torch.sqrt(var)  # the variance is predicted without softplus or exp


class LatentODE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(3, 4)
        self.head = GaussianHead()
        with torch.no_grad():
            self.head.fc.weight.zero_()
            self.head.fc.bias.copy_(torch.tensor([0.0, 0.1, 0.5, -0.3]))  # the second variance is -0.3

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        mu, std = self.head(torch.tanh(self.encoder(x)))
        return -torch.distributions.Normal(mu, std, validate_args=True).log_prob(target).mean()


def _normal_scale_sqrt_negative() -> Case:
    torch.manual_seed(0)
    model = LatentODE()
    return Case(step(model, model), (torch.randn(3, 3), torch.randn(3, 2)), model)


class BoxRegression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.bias.copy_(torch.tensor([1.2, -0.4]))  # the predicted height went negative: relu makes it 0

    def forward(self, feats: torch.Tensor, anchor_wh: torch.Tensor) -> torch.Tensor:
        wh = torch.relu(self.fc(feats))
        return torch.log(wh / anchor_wh).abs().mean()  # scale-invariant size loss


def _loss_check_raises() -> Case:
    torch.manual_seed(0)
    model = BoxRegression()

    def fn(feats: torch.Tensor, anchor_wh: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        loss = model(feats, anchor_wh)
        if not torch.isfinite(loss).all():  # detectron2's trainer check
            raise FloatingPointError(f"Loss became infinite or NaN at iteration=0!\nloss = {loss}")
        loss.backward()
        return loss

    return Case(fn, (torch.randn(2, 4), torch.tensor([[1.0, 2.0], [0.5, 1.5]])), model)


SCENARIOS = (
    WildScenario(
        "glow_invconv_negative_det",
        "NVIDIA/waveglow#103",
        "WaveGlow's invertible 1x1 convolution taking torch.logdet(W) of a W whose determinant is -1",
        Expect("op.log_domain", "aten.logdet.default", "invconv", "forward", "nan"),
        "logdet returns NaN by definition for a negative determinant (an internal where writes it): the log of "
        "a negative number in the user's call torch.logdet, not a NaN the user wrote",
        _glow_invconv_negative_det,
    ),
    WildScenario(
        "pcgrad_tiny_task_gradient",
        "WeiChengTseng/Pytorch-PCGrad#7",
        "PCGrad's projection g_i -= (g_i . g_j) g_j / ||g_j||**2 on float16 gradients of a task weighted 3e-5",
        Expect("op.division_by_zero", "aten.div.Tensor", None, "backward", "nan"),
        "||g_j||**2 rounds to 0 in float16 while g_i . g_j < 0: 0/0 in the projection, which runs on .grad "
        "after backward() and before the optimizer step: gradient post-processing, phase backward",
        _pcgrad_tiny_task_gradient,
    ),
    WildScenario(
        "clip_by_norm_zero_gradient",
        "PaddlePaddle/Paddle#30777",
        "a hand-written per-tensor clip g * max_norm / ||g|| on the zero gradient of a head the batch did not use",
        Expect("op.division_by_zero", "aten.reciprocal.default", None, "backward", "inf"),
        "max_norm / ||g|| is reciprocal(0) * max_norm = inf for head_box's zero gradients (then 0 * inf = NaN), "
        "in code on .grad after backward(): phase backward",
        _clip_by_norm_zero_gradient,
    ),
    WildScenario(
        "categorical_probs_nan",
        "shizhediao/Black-Box-Prompt-Learning#3",
        "Categorical(probs) over prompt probabilities renormalized by hand, one row clamped to all zeros",
        Expect("op.division_by_zero", "aten.div.Tensor", "policy", "forward", "nan"),
        "p / p.sum() is 0/0 for the all-zero row; validate_args then raises ValueError on the NaN probs: the "
        "diagnosis is the division's, with the raise in the evidence",
        _categorical_probs_nan,
    ),
    WildScenario(
        "multinomial_fp16_logits",
        "DLLXW/baby-llama2-chinese#33",
        "sampling with torch.multinomial from the softmax of float16 logits that overflowed",
        Expect("precision.overflow", "aten.mm.default", "lm_head", "forward", "inf"),
        "lm_head's logits reach 72000 > 65504 in float16 (finite in float32); softmax of Inf is NaN and "
        "multinomial raises RuntimeError on it",
        _multinomial_fp16_logits,
    ),
    WildScenario(
        "normal_scale_sqrt_negative",
        "ZijieH/CG-ODE#1",
        "Normal(mu, sqrt(var)) with a variance predicted without a positivity constraint",
        Expect("op.sqrt_domain", "aten.sqrt.default", "head", "forward", "nan"),
        "sqrt of the negative predicted variance -0.3 is NaN in the head; Normal's validate_args then raises "
        "ValueError on the NaN scale",
        _normal_scale_sqrt_negative,
    ),
    WildScenario(
        "loss_check_raises",
        "facebookresearch/detectron2#214",
        "a trainer's isfinite(loss) check raising FloatingPointError after a log of a zero box size",
        Expect("op.log_domain", "aten.log.default", "", "forward", "inf"),
        "relu makes the predicted height 0 and log(0 / h) = -inf in the root module; the loss check then raises",
        _loss_check_raises,
    ),
)

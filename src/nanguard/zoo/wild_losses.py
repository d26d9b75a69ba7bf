"""Wild scenarios in loss and training-step code (see ``nanguard.zoo.wild``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanguard.zoo.scenarios import Case, Expect, WildScenario

__all__ = ["SCENARIOS", "step"]


def step(model: nn.Module, loss_of: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A training step around ``loss_of``: zero the gradients, compute the loss, backward, return it."""

    def fn(*args: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        loss = loss_of(*args)
        loss.backward()
        return loss

    return fn


class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pi = nn.Linear(4, 3)
        self.v = nn.Linear(4, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.log_softmax(self.pi(obs), -1), self.v(obs).squeeze(-1)


def _ppo_std_one_sample() -> Case:
    torch.manual_seed(0)
    model = ActorCritic()

    def loss_of(obs: torch.Tensor, actions: torch.Tensor, returns: torch.Tensor, old_logp: torch.Tensor):
        logp_all, values = model(obs)
        logp = logp_all.gather(1, actions[:, None]).squeeze(1)
        adv = returns - values.detach()
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)  # one sample: std with correction 1 is 0/0
        ratio = torch.exp(logp - old_logp)
        return -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean() + (returns - values).pow(2).mean()

    args = (torch.tensor([[0.1, -0.2, 0.3, 0.4]]), torch.tensor([2]), torch.tensor([1.5]), torch.tensor([-1.1]))
    return Case(step(model, loss_of), args, model)


class BoxLoss(nn.Module):
    def forward(self, cls_logits: torch.Tensor, box_pred: torch.Tensor, labels: torch.Tensor, box_target: torch.Tensor):
        pos = labels > 0
        return F.cross_entropy(cls_logits, labels) + F.smooth_l1_loss(box_pred[pos], box_target[pos])


class Detector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(6, 8)
        self.cls_head = nn.Linear(8, 3)
        self.box_head = nn.Linear(8, 4)
        self.criterion = BoxLoss()

    def forward(self, anchors: torch.Tensor, labels: torch.Tensor, box_target: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.backbone(anchors))
        return self.criterion(self.cls_head(h), self.box_head(h), labels, box_target)


def _empty_positive_anchors() -> Case:
    torch.manual_seed(0)
    model = Detector()
    labels = torch.zeros(5, dtype=torch.long)  # a background-only image: no positive anchor
    return Case(step(model, model), (torch.randn(5, 6), labels, torch.zeros(5, 4)), model)


class Student(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lm_head = nn.Linear(8, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.emb(ids))


def _empty_mask_masked_mean() -> Case:
    torch.manual_seed(0)
    model = Student()

    def loss_of(ids: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        x = (F.softmax(teacher_logits, -1) * F.log_softmax(model(ids), -1)).sum(-1).view(-1)
        mask = (labels != -100).int().view(-1)
        return -torch.sum(x * mask, dim=0) / torch.sum(mask, dim=0)

    labels = torch.full((1, 4), -100)  # a prompt-only sample after truncation: nothing to learn
    return Case(step(model, loss_of), (torch.tensor([[1, 2, 3, 4]]), labels, torch.randn(1, 4, 10)), model)


class RotHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        scale = 1.01 + 0.0 * self.fc(x)  # the predicted rotation is off the manifold by 1 %
        return base * scale[..., None]


class GeodesicLoss(nn.Module):
    def forward(self, r_pred: torch.Tensor, r_gt: torch.Tensor) -> torch.Tensor:
        tr = torch.einsum("bij,bij->b", r_pred, r_gt)
        return torch.acos((tr - 1) / 2).mean()


class PoseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = RotHead()
        self.criterion = GeodesicLoss()

    def forward(self, x: torch.Tensor, base: torch.Tensor, r_gt: torch.Tensor) -> torch.Tensor:
        return self.criterion(self.head(x, base), r_gt)


def _acos_rotation_geodesic() -> Case:
    torch.manual_seed(0)
    model = PoseNet()
    eye = torch.eye(3).expand(2, 3, 3).clone()
    return Case(step(model, model), (torch.randn(2, 4), eye, eye.clone()), model)


class HandBCE(nn.Module):
    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(z)
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.criterion = HandBCE()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.criterion(self.fc(x).squeeze(-1), y)


def _bce_handwritten_saturated() -> Case:
    torch.manual_seed(0)
    model = Scorer()
    with torch.no_grad():
        model.fc.weight.fill_(10.0)
        model.fc.bias.zero_()
    x = torch.tensor([[1.0, 1.0, 1.0], [0.1, -0.2, 0.05]])  # first logit 30: sigmoid rounds to 1.0
    return Case(step(model, model), (x, torch.tensor([1.0, 0.0])), model)


class SoftmaxHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(self.fc(h), dim=-1))


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = SoftmaxHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def _log_of_softmax() -> Case:
    torch.manual_seed(0)
    model = Classifier()
    with torch.no_grad():
        model.head.fc.weight.copy_(torch.eye(3))
        model.head.fc.bias.zero_()
    x = torch.tensor([[0.0, 200.0, -50.0], [1.0, 0.5, 0.2]])  # a logit gap of 200: softmax underflows to 0
    return Case(step(model, lambda x, y: F.nll_loss(model(x), y)), (x, torch.tensor([0, 1])), model)


class GumbelSampler(nn.Module):
    def forward(self, logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits - torch.log(-torch.log(u)), dim=-1)


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.sampler = GumbelSampler()

    def forward(self, obs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self.sampler(self.fc(obs), u)


def _gumbel_noise_u_one() -> Case:
    torch.manual_seed(0)
    model = Policy()
    u = torch.tensor([[13, 200, 97], [255, 40, 128]], dtype=torch.float32) / 255  # u[1, 0] == 1.0
    value = torch.tensor([1.0, -0.5, 0.25])
    return Case(step(model, lambda obs, u: -(model(obs, u) * value).sum()), (torch.randn(2, 4), u), model)


class VAEEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, logvar = self.fc(x).chunk(2, dim=-1)
        return mu, logvar


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = VAEEncoder()
        self.decoder = nn.Linear(2, 4)

    def forward(self, x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        mu, logvar = self.encoder(x)
        recon = self.decoder(mu + eps * torch.exp(0.5 * logvar))
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1).mean()
        return ((recon - x) ** 2).mean() + kl


def _vae_logvar_exp_overflow() -> Case:
    torch.manual_seed(0)
    model = VAE()
    with torch.no_grad():
        model.encoder.fc.weight.zero_()
        model.encoder.fc.bias.copy_(torch.tensor([0.0, 0.0, 150.0, 1.0]))  # logvar[0] = 150
    return Case(step(model, model), (torch.randn(3, 4), torch.randn(3, 2)), model)


def _zero_rollout_temperature() -> Case:
    torch.manual_seed(0)
    model = nn.Linear(8, 16)  # the policy's output layer over a 16-token vocabulary
    temperature = 0.0  # greedy rollouts: the trainer reuses the rollout temperature

    def loss_of(h: torch.Tensor, tokens: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        logits = model(h).div(temperature)  # logprobs "at the rollout temperature"
        logp = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
        return -(logp * advantages).mean()

    return Case(step(model, loss_of), (torch.randn(4, 8), torch.tensor([1, 5, 2, 9]), torch.randn(4)), model)


SCENARIOS = (
    WildScenario(
        "ppo_std_one_sample",
        "DLR-RM/stable-baselines3#325",
        "PPO advantage normalization on a 1-sample minibatch: adv.std() is sqrt(0/0)",
        Expect("op.division_by_zero", "aten.std.correction", None, "forward", "nan"),
        "std with n=1 and correction=1 divides by n - correction = 0, in loss code outside any module",
        _ppo_std_one_sample,
    ),
    WildScenario(
        "zero_rollout_temperature",
        "radixark/miles#1190",
        "policy logprobs computed as logits.div(temperature) with a greedy rollout's temperature of 0.0",
        Expect("op.division_by_zero", "aten.div.Tensor", None, "forward", "inf"),
        "finite logits divided by the Python number 0.0 are +-inf, in loss code outside the policy module",
        _zero_rollout_temperature,
    ),
    WildScenario(
        "empty_positive_anchors",
        "pytorch/vision#2144",
        "box-regression smooth_l1_loss over the positive anchors of an image with none",
        Expect("data.no_valid_targets", "aten.smooth_l1_loss.default", "criterion", "data", "nan"),
        "the mean over an empty selection is 0/0; the selection is empty because the labels hold no foreground",
        _empty_positive_anchors,
    ),
    WildScenario(
        "empty_mask_masked_mean",
        "microsoft/LMOps#38",
        "distillation loss sum(x * mask) / sum(mask) with every label -100",
        Expect("data.no_valid_targets", "aten.div.Tensor", None, "data", "nan"),
        "0/0 in the division in loss code; the zero count comes from the batch's labels (all -100)",
        _empty_mask_masked_mean,
    ),
    WildScenario(
        "acos_rotation_geodesic",
        "pytorch/pytorch#8069",
        "geodesic rotation loss acos((trace - 1) / 2) with the cosine 1 % past 1",
        Expect("op.trig_domain", "aten.acos.default", "criterion", "forward", "nan"),
        "acos of 1.0302, far outside [-1, 1] (not a rounding boundary), in the criterion module",
        _acos_rotation_geodesic,
    ),
    WildScenario(
        "bce_handwritten_saturated",
        "torch/nn#730",
        "hand-written BCE -(y log p + (1 - y) log(1 - p)) with a sigmoid that rounds to 1",
        Expect("op.log_domain", "aten.log.default", "criterion", "forward", "inf"),
        "log(1 - p) with p == 1.0 exactly is log(0) = -inf, in the criterion",
        _bce_handwritten_saturated,
    ),
    WildScenario(
        "log_of_softmax",
        "pytorch/pytorch#1620",
        "log(softmax(x)) where a logit gap of 200 underflows a probability to 0",
        Expect("op.log_domain", "aten.log.default", "head", "forward", "inf"),
        "softmax underflows to 0 for a gap of 200 in float32; log(0) = -inf in the head",
        _log_of_softmax,
    ),
    WildScenario(
        "gumbel_noise_u_one",
        "pytorch/pytorch#4517",
        "Gumbel noise -log(-log(u)) with a uniform sample of exactly 1.0",
        Expect("op.log_domain", "aten.log.default", "sampler", "forward", "inf"),
        "log(u) = 0 for u == 1, then the outer log(0) = -inf, in the sampler",
        _gumbel_noise_u_one,
    ),
    WildScenario(
        "vae_logvar_exp_overflow",
        "vanderschaarlab/synthcity#331",
        "VAE whose log-variance reaches 150: logvar.exp() overflows float32",
        Expect("op.exp_overflow", "aten.exp.default", "", "forward", "inf"),
        "exp(150) > float32 max; the KL term's exp runs in the root module's forward",
        _vae_logvar_exp_overflow,
    ),
)

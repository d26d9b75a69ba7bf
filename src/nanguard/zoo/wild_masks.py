"""Wild scenarios with masks, fills and writes of non-finite values (see ``nanguard.zoo.wild``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanguard.zoo.scenarios import Case, Expect, WildScenario
from nanguard.zoo.wild_losses import step

__all__ = ["SCENARIOS"]


class PadAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.k = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, key_pad: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 2.0
        scores = scores.masked_fill(key_pad[:, None, :], float("-inf"))
        return torch.softmax(scores, -1) @ x


class AttnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = PadAttention()

    def forward(self, x: torch.Tensor, key_pad: torch.Tensor) -> torch.Tensor:
        return self.attn(x, key_pad)


def _attention_fully_masked_row() -> Case:
    torch.manual_seed(0)
    model = AttnNet()
    key_pad = torch.tensor([[False, False, True], [True, True, True]])  # sample 2 is all padding
    return Case(step(model, lambda x, pad: model(x, pad).sum()), (torch.randn(2, 3, 4), key_pad), model)


class MaskedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6)
        self.register_buffer("banned", torch.tensor([False, False, False, False, True, True]))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h).masked_fill(self.banned, float("-inf"))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = MaskedHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def _label_smoothing_masked_vocab() -> Case:
    torch.manual_seed(0)
    model = Decoder()
    loss_of = lambda x, y: F.cross_entropy(model(x), y, label_smoothing=0.1)  # noqa: E731
    return Case(step(model, loss_of), (torch.randn(3, 8), torch.tensor([0, 1, 3])), model)


class LogPartition(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emit = nn.Linear(4, 5)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # An additive mask: 0 where allowed, -inf elsewhere.
        return torch.logsumexp(self.emit(h) + torch.where(mask, 0.0, float("-inf")), dim=-1)


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.crf = LogPartition()

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.crf(h, mask)


def _logsumexp_fully_masked() -> Case:
    torch.manual_seed(0)
    model = Tagger()
    mask = torch.tensor([[True] * 5, [True, True, False, True, False], [False] * 5])  # row 3 is padding
    valid = torch.tensor([True, True, False])
    loss_of = lambda h, mask, valid: model(h, mask)[valid].mean()  # noqa: E731
    return Case(step(model, loss_of), (torch.randn(3, 4), mask, valid), model)


class MaskedPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Linear(4, 5)

    def forward(self, obs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self.logits(obs).masked_fill(~valid, float("-inf"))


class Agent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.policy = MaskedPolicy()

    def forward(self, obs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self.policy(obs, valid)


def _masked_action_entropy() -> Case:
    torch.manual_seed(0)
    model = Agent()

    def loss_of(obs: torch.Tensor, valid: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(model(obs, valid), -1)
        entropy = -(logp.exp() * logp).sum(-1).mean()  # 0 * -inf at the masked actions
        return -logp.gather(1, actions[:, None]).mean() - 0.01 * entropy

    valid = torch.tensor([[True, True, False, True, False], [True, False, True, True, True]])
    return Case(step(model, loss_of), (torch.randn(2, 4), valid, torch.tensor([0, 2])), model)


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(5, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.encoder(x))).squeeze(-1)


def _neginf_input_feature() -> Case:
    torch.manual_seed(0)
    model = Regressor()
    feats = torch.randn(4, 5)
    feats[2, 3] = float("-inf")  # the log-energy of a silent frame
    return Case(step(model, lambda x, t: F.mse_loss(model(x), t)), (feats, torch.randn(4)), model)


class PadEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        h[pad] = float("nan")  # a "missing" marker
        return h


class PadNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = PadEncoder()
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.out(self.encoder(x, pad).mean(1))


def _inplace_nan_index_write() -> Case:
    torch.manual_seed(0)
    model = PadNet()
    pad = torch.tensor([[False, False, True], [False, False, False]])
    return Case(step(model, lambda x, pad: model(x, pad).sum()), (torch.randn(2, 3, 3), pad), model)


SCENARIOS = (
    WildScenario(
        "attention_fully_masked_row",
        "THUwangcy/ReChorus#8",
        "attention with masked_fill(-inf) over keys, one sample all padding",
        Expect("op.masked_softmax", "aten._softmax.default", "attn", "forward", "nan"),
        "softmax of a row that is entirely -inf is 0/0, in the attention module",
        _attention_fully_masked_row,
    ),
    WildScenario(
        "label_smoothing_masked_vocab",
        "facebookresearch/pytext#1698",
        "label smoothing over logits with banned tokens filled with -inf",
        Expect("op.mask_fill_in_loss", "aten.masked_fill.Scalar", "head", "forward", "inf"),
        "label smoothing averages log-probabilities over every class, -inf at the head's masked_fill; inputs finite",
        _label_smoothing_masked_vocab,
    ),
    WildScenario(
        "logsumexp_fully_masked",
        "pytorch/pytorch#31829",
        "CRF log-partition logsumexp over an additive -inf mask with a fully masked padding row",
        Expect("op.masked_softmax", "aten.sub.Tensor", "crf", "backward", "nan"),
        "LogsumexpBackward0 computes exp(x - result) with x = result = -inf for the all-masked row",
        _logsumexp_fully_masked,
    ),
    WildScenario(
        "masked_action_entropy",
        "tensorforce/tensorforce#586",
        "entropy bonus -(p * log p) over action logits masked with -inf",
        Expect("op.mask_fill_in_loss", "aten.masked_fill.Scalar", "policy", "forward", "inf"),
        "the policy's -inf fill reaches the entropy sum (0 * -inf); every input is finite",
        _masked_action_entropy,
    ),
    WildScenario(
        "neginf_input_feature",
        "A2Zadeh/CMU-MultimodalSDK#179",
        "a dataset feature holding -inf (log-energy of silence), not a mask",
        Expect("data.nonfinite", None, "encoder", "data", "inf"),
        "the batch's float feature holds -inf, first read by the encoder",
        _neginf_input_feature,
    ),
    WildScenario(
        "inplace_nan_index_write",
        "pytorch/pytorch#64305",
        "model code writing NaN as a missing-value marker: h[pad] = nan",
        Expect("op.nan_write", "aten.index_put_.default", "encoder", "forward", "nan"),
        "index_put_ writes NaN into the encoder's activations; every input is finite",
        _inplace_nan_index_write,
    ),
)

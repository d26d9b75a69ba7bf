"""Wild scenarios where infinities meet infinities, and the log family at the edge of its domain
(see ``nanguard.zoo.wild``).

Infinities meeting: a softmax, logsumexp or running max written out by hand keeps ``-inf`` as a
sentinel on purpose; the NaN comes from the arithmetic that combines two of them
(``-inf - (-inf)``) over a row or block that is entirely masked. That op is the origin, and the
cause is a fully masked row (``op.masked_softmax``), not the write of the sentinel.

The log family: ``xlogy`` (what ``torch.distributions`` use for ``(a - 1) * log(x)``), ``lgamma``
and ``log1p`` at the end of their domain are ``op.log_domain`` at that op, with the
distribution's method named where one ran it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Beta, Dirichlet

from nanguard.zoo.scenarios import Case, Expect, WildScenario
from nanguard.zoo.wild_losses import step

__all__ = ["SCENARIOS"]

_NEG = float("-inf")


class BlockAttention(nn.Module):
    """Attention over key blocks with an online softmax: a running max initialised to -inf."""

    def __init__(self, dim: int = 4, block: int = 2) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.block = block

    def forward(self, x: torch.Tensor, key_pad: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        b, t, d = x.shape
        running_max = torch.full((b, t, 1), _NEG)
        total, acc = torch.zeros(b, t, 1), torch.zeros(b, t, d)
        for i in range(0, t, self.block):
            scores = q @ k[:, i : i + self.block].transpose(-1, -2) / d**0.5
            scores = scores.masked_fill(key_pad[:, None, i : i + self.block], _NEG)
            new_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))
            p = torch.exp(scores - new_max)  # -inf - (-inf) when the block and everything before it is padding
            scale = torch.exp(running_max - new_max)
            total = scale * total + p.sum(-1, keepdim=True)
            acc = scale * acc + p @ v[:, i : i + self.block]
            running_max = new_max
        return acc / total


class BlockNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = BlockAttention()

    def forward(self, x: torch.Tensor, key_pad: torch.Tensor) -> torch.Tensor:
        return self.attn(x, key_pad)


def _online_softmax_padded_block() -> Case:
    torch.manual_seed(0)
    model = BlockNet()
    # Sample 1 is left-padded: its first key block is all padding.
    key_pad = torch.tensor([[True, True, False, False], [False, False, False, False]])
    return Case(step(model, lambda x, pad: model(x, pad).square().mean()), (torch.randn(2, 4, 4), key_pad), model)


class EdgeSoftmax(nn.Module):
    """Graph attention: a softmax over each node's incoming edges, with a segment max from scatter_reduce."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(6, 1)

    def forward(self, edge_feats: torch.Tensor, dst: torch.Tensor, edge_ok: torch.Tensor, nodes: int) -> torch.Tensor:
        logits = self.score(edge_feats).squeeze(-1).masked_fill(~edge_ok, _NEG)
        seg_max = torch.full((nodes,), _NEG).scatter_reduce(0, dst, logits, "amax", include_self=True)
        shifted = logits - seg_max[dst]  # -inf - (-inf) on the edges of a node whose every edge is masked
        e = shifted.exp()
        denom = torch.zeros(nodes).index_add(0, dst, e)
        return e / denom[dst]


class GraphNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = EdgeSoftmax()
        self.out = nn.Linear(6, 1)

    def forward(self, edge_feats: torch.Tensor, dst: torch.Tensor, edge_ok: torch.Tensor) -> torch.Tensor:
        weights = self.conv(edge_feats, dst, edge_ok, 3)
        return self.out(edge_feats * weights[:, None]).sum()


def _segment_softmax_masked_node() -> Case:
    torch.manual_seed(0)
    model = GraphNet()
    dst = torch.tensor([0, 0, 1, 1, 2, 2])
    edge_ok = torch.tensor([True, True, True, False, False, False])  # node 2: every edge cut off
    return Case(step(model, lambda e, d, ok: model(e, d, ok)), (torch.randn(6, 6), dst, edge_ok), model)


class LogSpaceHMM(nn.Module):
    """The forward algorithm in log space with a hand-written logsumexp; impossible states start at -inf."""

    def __init__(self, states: int = 3, feats: int = 4) -> None:
        super().__init__()
        self.emit = nn.Linear(feats, states)
        self.trans = nn.Parameter(torch.zeros(states, states))

    def forward(self, obs: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        emissions = F.log_softmax(self.emit(obs), -1)  # (T, states)
        alpha = start + emissions[0]
        for t in range(1, obs.shape[0]):
            scores = alpha[:, None] + self.trans  # (from, to)
            top = scores.amax(0, keepdim=True)
            alpha = (top + (scores - top).exp().sum(0, keepdim=True).log()).squeeze(0) + emissions[t]
        top = alpha.amax()
        return top + (alpha - top).exp().sum().log()


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hmm = LogSpaceHMM()

    def forward(self, obs: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return self.hmm(obs, start)


def _logspace_forward_no_start_state() -> Case:
    torch.manual_seed(0)
    model = Tagger()
    start = torch.full((3,), _NEG)  # a log-prior built from a mask that allows no start state
    return Case(step(model, lambda obs, start: -model(obs, start)), (torch.randn(4, 4), start), model)


class BetaActor(nn.Module):
    """A Beta policy head; its forward returns the log-density of the actions taken."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 2)

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        conc = F.softplus(self.body(obs)) + 1.0  # alpha, beta > 1: the density is 0 at both bounds
        return Beta(conc[:, 0], conc[:, 1], validate_args=False).log_prob(actions)


class BetaAgent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor = BetaActor()

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return self.actor(obs, actions)


def _beta_policy_clipped_action() -> Case:
    torch.manual_seed(0)
    model = BetaAgent()
    actions = torch.tensor([0.2, 1.3, 0.7, 0.5]).clamp(0.0, 1.0)  # the env clipped one action to the bound
    advantages = torch.tensor([0.5, -1.0, 0.3, 0.8])

    def loss_of(obs: torch.Tensor, actions: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        return -(model(obs, actions) * adv).mean()

    return Case(step(model, loss_of), (torch.randn(4, 4), actions, advantages), model)


class TopicEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conc = nn.Linear(5, 3)

    def forward(self, bow: torch.Tensor) -> torch.Tensor:
        return F.softplus(self.conc(bow)) + 1.0


def _dirichlet_topic_vertex() -> Case:
    torch.manual_seed(0)
    model = TopicEncoder()
    # Topic proportions from normalised counts: document 2 has no word of topic 3.
    counts = torch.tensor([[3.0, 1.0, 2.0], [4.0, 2.0, 0.0]])
    props = counts / counts.sum(-1, keepdim=True)

    def loss_of(bow: torch.Tensor, props: torch.Tensor) -> torch.Tensor:
        return -Dirichlet(model(bow), validate_args=False).log_prob(props).mean()

    return Case(step(model, loss_of), (torch.randn(2, 5), props), model)


class NBDecoder(nn.Module):
    """A negative-binomial count likelihood written out with lgamma; theta from a ReLU can reach 0."""

    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Linear(4, 3)
        self.theta = nn.Linear(4, 3)

    def forward(self, z: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        mu, theta = F.softplus(self.mu(z)), torch.relu(self.theta(z))
        log_theta_mu = torch.log(theta + mu + 1e-8)
        return (
            theta * (torch.log(theta + 1e-8) - log_theta_mu)
            + counts * (torch.log(mu + 1e-8) - log_theta_mu)
            + torch.lgamma(counts + theta)
            - torch.lgamma(theta)
            - torch.lgamma(counts + 1)
        )


class CountVAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = NBDecoder()

    def forward(self, z: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.decoder(z, counts)


def _nb_lgamma_zero_dispersion() -> Case:
    torch.manual_seed(0)
    model = CountVAE()
    counts = torch.tensor([[0.0, 2.0, 5.0], [1.0, 0.0, 3.0]])
    return Case(step(model, lambda z, c: -model(z, c).mean()), (torch.randn(2, 4), counts), model)


class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.head(x).squeeze(-1) * 30.0)  # a sharp gate: saturates to exactly 1.0


def _log1p_saturated_sigmoid() -> Case:
    torch.manual_seed(0)
    model = Scorer()

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = model(x)
        return -(y * torch.log(p + 1e-12) + (1 - y) * torch.log1p(-p)).mean()  # log1p(-1) = -inf at p == 1

    x = torch.randn(4, 4)
    x[2] = model.head.weight.detach()[0] * 40.0  # one sample deep on the positive side
    return Case(step(model, loss_of), (x, torch.tensor([1.0, 0.0, 0.0, 1.0])), model)


SCENARIOS = (
    WildScenario(
        "online_softmax_padded_block",
        "flashinfer-ai/flashinfer#1178",
        "blockwise attention with an online softmax whose running max starts at -inf; a fully padded key block",
        Expect("op.masked_softmax", "aten.sub.Tensor", "attn", "forward", "nan"),
        "scores - new_max is -inf - (-inf) for the left-padded sample's first block: the sub combines the "
        "running max's -inf sentinel with the mask's -inf; the torch.full and masked_fill writes are intentional",
        _online_softmax_padded_block,
    ),
    WildScenario(
        "segment_softmax_masked_node",
        "deepmodeling/deepmd-kit#5717",
        "graph attention: a per-node softmax with a scatter_reduce segment max over masked edges",
        Expect("op.masked_softmax", "aten.sub.Tensor", "conv", "forward", "nan"),
        "node 2 has every edge masked to -inf, so its segment max (from a -inf start) is -inf and "
        "logits - seg_max[dst] is -inf - (-inf) in the conv's sub",
        _segment_softmax_masked_node,
    ),
    WildScenario(
        "logspace_forward_no_start_state",
        "pytorch/pytorch#49724",
        "an HMM forward algorithm in log space with a hand-written logsumexp; the start log-prior allows no state",
        Expect("op.masked_softmax", "aten.sub.Tensor", "hmm", "forward", "nan"),
        "every start state is -inf, so the first step's scores are all -inf and scores - max is "
        "-inf - (-inf): the hand-written logsumexp over a fully masked row",
        _logspace_forward_no_start_state,
    ),
    WildScenario(
        "beta_policy_clipped_action",
        "pytorch/pytorch#92260",
        "a Beta policy's log_prob of an action the environment clipped to the bound 1.0",
        Expect("op.log_domain", "aten.xlogy.Tensor", "actor", "forward", "inf"),
        "Beta.log_prob computes xlogy(beta - 1, 1 - x) with beta > 1 and 1 - x == 0: log(0) = -inf at "
        "the edge of the support, in the actor",
        _beta_policy_clipped_action,
    ),
    WildScenario(
        "dirichlet_topic_vertex",
        "pyro-ppl/pyro#1983",
        "Dirichlet.log_prob of topic proportions with a zero component, concentrations > 1",
        Expect("op.log_domain", "aten.xlogy.Tensor", None, "forward", "inf"),
        "Dirichlet.log_prob computes xlogy(alpha - 1, x) with alpha > 1 and x == 0 for document 2's "
        "third topic: -inf, in the loss code outside the model",
        _dirichlet_topic_vertex,
    ),
    WildScenario(
        "nb_lgamma_zero_dispersion",
        "cellarium-ai/cellarium-ml#171",
        "a negative-binomial likelihood with lgamma(theta) where theta from a ReLU is exactly 0",
        Expect("op.log_domain", "aten.lgamma.default", "decoder", "forward", "inf"),
        "lgamma has a pole at 0: theta = relu(.) == 0 for a gene gives lgamma(0) = inf (lgamma(counts + "
        "theta) at a zero count is the first to hit it), in the decoder",
        _nb_lgamma_zero_dispersion,
    ),
    WildScenario(
        "log1p_saturated_sigmoid",
        "deepspeedai/DeepSpeedExamples#501",
        "a hand-written binary cross-entropy with log1p(-p) on a sigmoid that saturates to exactly 1.0",
        Expect("op.log_domain", "aten.log1p.default", None, "forward", "inf"),
        "sigmoid(30 * z) rounds to 1.0 in float32 for the third sample, whose label is 0: log1p(-1) = -inf "
        "in the loss code",
        _log1p_saturated_sigmoid,
    ),
)

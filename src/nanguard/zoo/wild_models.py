"""Wild scenarios in model code: checkpointing, compile, custom Functions, low precision (see ``nanguard.zoo.wild``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nanguard.zoo.scenarios import Case, Expect, WildScenario
from nanguard.zoo.wild_losses import step

__all__ = ["SCENARIOS"]


class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).pow(2).sum(-1).sqrt()  # a hand-written L2 norm without eps


class CheckpointedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = NormBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=True)


def _checkpoint_reentrant_sqrt() -> Case:
    torch.manual_seed(0)
    model = CheckpointedNet()
    x = torch.tensor([[1.0, 2.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    return Case(step(model, lambda x: model(x).sum()), (x,), model)


class LogHead(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.relu(h))


class CompiledNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.feat = nn.Linear(4, 4)
        self.head = LogHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.feat(x))


def _compile_log_zero() -> Case:
    torch.manual_seed(0)
    net = CompiledNet()
    with torch.no_grad():
        net.feat.weight.copy_(torch.eye(4))
        net.feat.bias.zero_()
    model: nn.Module = torch.compile(net, backend="eager")  # type: ignore[assignment]  # an OptimizedModule
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5], [2.0, 1.0, 1.5, -4.0]])  # relu zeroes the negatives
    return Case(step(model, lambda x: model(x).sum()), (x,), model)


class ScaleInv(torch.autograd.Function):
    """x / |x| with a guarded forward and an unguarded hand-written backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        norm = x.norm(dim=-1, keepdim=True)
        ctx.save_for_backward(norm)
        return x / norm.clamp_min(1e-6)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (norm,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad / norm


class Normalizer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ScaleInv.apply(x)


class FunctionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4, bias=False)
        self.norm = Normalizer()
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.embed(x)))


def _custom_function_backward() -> Case:
    torch.manual_seed(0)
    model = FunctionNet()
    return Case(step(model, lambda x: model(x).sum()), (torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]),), model)


class TinyEpsLayerNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-12) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) * torch.rsqrt(var + self.eps) * self.weight


class NormEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8, bias=False)
        self.norm = TinyEpsLayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


def _layernorm_fp16_tiny_eps() -> Case:
    torch.manual_seed(0)
    model = NormEncoder().half()
    x = torch.tensor([[1.0, -0.5, 0.25, 2.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float16)  # a padding row
    return Case(step(model, lambda x: model(x).float().pow(2).sum()), (x,), model)


class UnitEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 4, padding_idx=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids)
        return e / e.norm(dim=-1, keepdim=True)


class Retriever(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = UnitEncoder()

    def forward(self, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return self.encoder(q) @ self.encoder(d).T


def _normalize_zero_embedding() -> Case:
    torch.manual_seed(0)
    model = Retriever()
    q, d = torch.tensor([1, 2, 0]), torch.tensor([3, 4, 5])  # a padded query slot: the zero embedding row
    return Case(step(model, lambda q, d: F.cross_entropy(model(q, d) / 0.1, torch.arange(3))), (q, d), model)


class Gamma(nn.Module):
    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return img ** (1 / 2.2)


class GammaDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.gamma = Gamma()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.gamma(self.fc(z))


def _pow_fractional_negative() -> Case:
    torch.manual_seed(0)
    model = GammaDecoder()
    with torch.no_grad():
        model.fc.weight.fill_(0.5)
        model.fc.bias.copy_(torch.tensor([0.0, 0.5, 1.0, -5.0, 0.2, 0.3]))  # the fourth pixel is -3
    target = torch.full((2, 6), 0.5)
    return Case(step(model, lambda z, t: F.mse_loss(model(z), t)), (torch.ones(2, 4), target), model)


class DenseReluDense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wi = nn.Linear(8, 16, bias=False)
        self.wo = nn.Linear(16, 8, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.wo(torch.relu(self.wi(h)))


class T5Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = DenseReluDense()
        self.head = nn.Linear(8, 1, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.ff(h))


def _t5_fp16_pretrained_overflow() -> Case:
    torch.manual_seed(0)
    model = T5Block()
    with torch.no_grad():  # "pretrained" weights, large for their fan-in
        model.ff.wi.weight.fill_(1.0)
        model.ff.wo.weight.copy_(40.0 * (1 + 0.25 * torch.randn(8, 16)))
        model.head.weight.fill_(1e-3)
    model.half()
    h = torch.full((2, 8), 20.0, dtype=torch.float16)  # wi -> 160 each, wo -> ~1.0e5 > 65504
    return Case(step(model, lambda h: model(h).float().pow(2).mean()), (h,), model)


SCENARIOS = (
    WildScenario(
        "checkpoint_reentrant_sqrt",
        "pytorch/pytorch#2421",
        "gradient of a hand-written L2 norm at a zero row, inside a block under checkpoint(use_reentrant=True)",
        Expect("op.sqrt_domain", "aten.div.Tensor", "block", "backward", "inf"),
        "SqrtBackward0 computes grad / (2 * sqrt(0)); the sqrt ran in the checkpointed block",
        _checkpoint_reentrant_sqrt,
    ),
    WildScenario(
        "compile_log_zero",
        "pytorch/pytorch#114109",
        "torch.compile'd model taking log(relu(h)) of zeros",
        Expect("op.log_domain", "aten.log.default", "head", "forward", "inf"),
        "log(0) = -inf in the head; module names are the user's, without the _orig_mod. prefix",
        _compile_log_zero,
    ),
    WildScenario(
        "custom_function_backward",
        "pytorch/pytorch#52248",
        "a custom autograd.Function whose hand-written backward divides by a zero norm",
        Expect("op.division_by_zero", "aten.div.Tensor", "norm", "backward", "inf"),
        "grad / norm with norm 0 in the Function's backward; Function.apply ran in module 'norm'",
        _custom_function_backward,
    ),
    WildScenario(
        "layernorm_fp16_tiny_eps",
        "pytorch/pytorch#41527",
        "hand-written float16 LayerNorm with eps=1e-12 on an all-zero padding row",
        Expect("norm.zero_variance", "aten.rsqrt.default", "norm", "forward", "inf"),
        "eps=1e-12 rounds to 0 in float16, so rsqrt(0 + eps) of the zero row's variance is +inf",
        _layernorm_fp16_tiny_eps,
    ),
    WildScenario(
        "normalize_zero_embedding",
        "HKUDS/LightRAG#3421",
        "cosine similarity e / |e| of the zero padding embedding",
        Expect("op.division_by_zero", "aten.div.Tensor", "encoder", "forward", "nan"),
        "0 / 0 in the encoder's division by the norm of the zero (padding_idx) row",
        _normalize_zero_embedding,
    ),
    WildScenario(
        "pow_fractional_negative",
        "pytorch/pytorch#75405",
        "gamma correction img ** (1 / 2.2) of a negative pixel",
        Expect("op.sqrt_domain", "aten.pow.Tensor_Scalar", "gamma", "forward", "nan"),
        "a fractional power of -3 is NaN, in the gamma module",
        _pow_fractional_negative,
    ),
    WildScenario(
        "t5_fp16_pretrained_overflow",
        "huggingface/transformers#5651",
        "float16 fine-tuning of a pretrained feed-forward whose wo output passes 65504",
        Expect("precision.overflow", "aten.mm.default", "ff.wo", "forward", "inf"),
        "wo(h) is ~1.0e5: Inf in float16, finite in float32; the weights are pretrained, not a bad init",
        _t5_fp16_pretrained_overflow,
    ),
)

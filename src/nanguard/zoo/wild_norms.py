"""Wild scenarios of normalizations and of divisions inside composite ops (see ``nanguard.zoo.wild``).

A normalization is told by what it computes (a variance, mean of squares or norm of the tensor it
divides), whatever its class is called; a composite op (weight_norm, a class-weighted loss) that
divides inside names its denominator.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import spectral_norm, weight_norm

from nanguard.zoo.scenarios import Case, Expect, WildScenario
from nanguard.zoo.wild_losses import step

__all__ = ["SCENARIOS"]


class TransformerLayerNormFp16(nn.Module):
    """A float16 LayerNorm kernel written out: eps is added to the variance in float16."""

    def __init__(self, d: int, eps: float = 1e-12) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True) + self.eps
        return (x - mu) * torch.rsqrt(var) * self.weight + self.bias


class Fp16Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8, bias=False)
        self.ln = TransformerLayerNormFp16(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.proj(x))


def _fp16_layernorm_kernel_eps_lost() -> Case:
    torch.manual_seed(0)
    model = Fp16Encoder().half()
    x = torch.tensor([[0.5, -1.0, 2.0, 0.25], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float16)  # a zero padding row
    return Case(step(model, lambda x: model(x).float().pow(2).sum()), (x,), model)


class FusedRMSNormAffine(nn.Module):
    """An RMSNorm rewritten to match a fused kernel's call, its eps left at 0."""

    def __init__(self, d: int, eps: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class TokenEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 6, padding_idx=0)
        self.norm = FusedRMSNormAffine(6)
        self.head = nn.Linear(6, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(ids)))


def _rmsnorm_eps_zero_unnamed() -> Case:
    torch.manual_seed(0)
    model = TokenEncoder()
    ids = torch.tensor([[3, 5, 0, 0]])  # right padding: the padding_idx row of the embedding is all zeros
    return Case(step(model, lambda ids: F.cross_entropy(model(ids)[0], torch.tensor([1, 2, 0, 0]))), (ids,), model)


class FeatureNorm(nn.Module):
    """Named like a normalization, but returns the features' L2 magnitude (for a penalty)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.pow(2).sum(-1).sqrt()


class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6, bias=False)
        self.feat_norm = FeatureNorm()
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return self.head(h).mean() + 0.01 * self.feat_norm(h).mean()


def _norm_named_magnitude_penalty() -> Case:
    torch.manual_seed(0)
    model = Embedder()
    x = torch.tensor([[1.0, -0.5, 0.25, 2.0], [0.0, 0.0, 0.0, 0.0]])  # a silent frame: all-zero features
    return Case(step(model, model), (x,), model)


class Vocoder(nn.Module):
    """HiFi-GAN-like: convolutions under weight_norm, the output one initialized to zero."""

    def __init__(self) -> None:
        super().__init__()
        with warnings.catch_warnings():  # the old weight_norm, as HiFi-GAN imports it, is deprecated
            warnings.simplefilter("ignore")
            self.conv_pre = weight_norm(nn.Conv1d(2, 4, 3, padding=1))
            self.conv_post = weight_norm(nn.Conv1d(4, 1, 3, padding=1))
        with torch.no_grad():
            self.conv_post.weight_v.zero_()  # type: ignore[operator]

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv_post(F.leaky_relu(self.conv_pre(mel), 0.1)))


def _weight_norm_zero_init() -> Case:
    torch.manual_seed(0)
    model = Vocoder()
    return Case(
        step(model, lambda mel, wav: F.l1_loss(model(mel), wav)), (torch.randn(2, 2, 8), torch.randn(2, 1, 8)), model
    )


class SegHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Conv2d(3, 8, 3, padding=1)
        self.classifier = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.relu(self.backbone(x)))


# Class 0 is the void / background class: weight 0, so only organs count.
_ORGAN_WEIGHTS = torch.tensor([0.0, 1.0, 2.0, 4.0])


def _seg_void_crop_class_weight() -> Case:
    torch.manual_seed(0)
    model = SegHead()
    crop = torch.zeros(2, 5, 5, dtype=torch.long)  # a random crop that holds background only
    loss_of = lambda x, y: F.cross_entropy(model(x), y, weight=_ORGAN_WEIGHTS)  # noqa: E731
    return Case(step(model, loss_of), (torch.randn(2, 3, 5, 5), crop), model)


class TextClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids))


def _class_weights_zeroed() -> Case:
    torch.manual_seed(0)
    model = TextClassifier()
    weights = torch.zeros(3)  # the inverse-frequency class weights, zeroed on their way to the device
    loss_of = lambda ids, y: F.cross_entropy(model(ids), y, weight=weights)  # noqa: E731
    return Case(step(model, loss_of), (torch.tensor([[1, 4, 7], [2, 9, 3]]), torch.tensor([0, 2])), model)


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.out = spectral_norm(nn.Linear(6, 1))
        with torch.no_grad():
            self.out.weight_orig.zero_()  # type: ignore[operator]  # a zero-initialized output layer, as in a residual start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(x)))


def _spectral_norm_zero_weight() -> Case:
    torch.manual_seed(0)
    model = Critic()
    return Case(
        step(model, lambda real, fake: model(fake).mean() - model(real).mean()),
        (torch.randn(3, 4), torch.randn(3, 4)),
        model,
    )


class BagEncoder(nn.Module):
    """Average word embeddings; unknown words map to the zero row."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids).mean(1)


def _cos_sim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a_n = a / a.norm(dim=1)[:, None]
    b_n = b / b.norm(dim=1)[:, None]
    return a_n @ b_n.T


def _cosine_sim_zero_embedding() -> Case:
    torch.manual_seed(0)
    model = BagEncoder()
    queries = torch.tensor([[1, 2, 3], [0, 0, 0]])  # the second sentence has only unknown words
    docs = torch.tensor([[4, 5, 6], [7, 8, 9]])
    loss_of = lambda q, d: F.cross_entropy(_cos_sim(model(q), model(d)) / 0.05, torch.arange(2))  # noqa: E731
    return Case(step(model, loss_of), (queries, docs), model)


class AdaIN(nn.Module):
    """Adaptive instance normalization with the usual calc_mean_std (unbiased var over H*W)."""

    def forward(self, content: torch.Tensor, style: torch.Tensor) -> torch.Tensor:
        n, c = content.shape[:2]
        c_var = content.view(n, c, -1).var(dim=2) + 1e-5
        c_mean = content.view(n, c, -1).mean(dim=2)
        s_std = (style.view(n, c, -1).var(dim=2) + 1e-5).sqrt()
        s_mean = style.view(n, c, -1).mean(dim=2)
        normalized = (content - c_mean[..., None, None]) / c_var.sqrt()[..., None, None]
        return normalized * s_std[..., None, None] + s_mean[..., None, None]


class StyleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 4, 3, stride=2)  # a 3x3 image down to a 1x1 feature map
        self.adain = AdaIN()
        self.dec = nn.Conv2d(4, 3, 1)

    def forward(self, content: torch.Tensor, style: torch.Tensor) -> torch.Tensor:
        return self.dec(self.adain(self.enc(content), self.enc(style)))


def _adain_one_element() -> Case:
    torch.manual_seed(0)
    model = StyleNet()
    content, style = torch.randn(1, 3, 3, 3), torch.randn(1, 3, 3, 3)
    return Case(step(model, lambda c, s: (model(c, s) - c[:, :, :1, :1]).pow(2).mean()), (content, style), model)


SCENARIOS = (
    WildScenario(
        "fp16_layernorm_kernel_eps_lost",
        "deepspeedai/DeepSpeed#581",
        "a float16 LayerNorm kernel written out (class not named *Norm) whose eps 1e-12 rounds to 0, on a zero row",
        Expect("norm.zero_variance", "aten.rsqrt.default", "ln", "forward", "inf"),
        "var + 1e-12 is 0 in float16 for the padding row, rsqrt(0) = inf; it is a normalization by what it "
        "computes (the mean of squares of x - mean(x), then multiplied into x - mean(x)), whatever its name",
        _fp16_layernorm_kernel_eps_lost,
    ),
    WildScenario(
        "rmsnorm_eps_zero_unnamed",
        "NVIDIA/apex#1295",
        "a hand-written FusedRMSNormAffine with eps=0 on the zero embedding row of a padding token",
        Expect("norm.zero_variance", "aten.rsqrt.default", "norm", "forward", "inf"),
        "the padding_idx row is all zeros, so mean(x**2) is 0 and rsqrt(0 + 0) = inf: a zero mean of squares, "
        "not a negative value",
        _rmsnorm_eps_zero_unnamed,
    ),
    WildScenario(
        "norm_named_magnitude_penalty",
        "tenstorrent/tt-metal#55585",
        "a module named FeatureNorm that returns sqrt(sum(h**2)) for a penalty, on an all-zero feature row",
        Expect("op.sqrt_domain", "aten.div.Tensor", "feat_norm", "backward", "inf"),
        "SqrtBackward0 computes grad / (2 * sqrt(0)); FeatureNorm divides nothing by its result, so it is no "
        "normalization whatever its name",
        _norm_named_magnitude_penalty,
    ),
    WildScenario(
        "weight_norm_zero_init",
        "pytorch/pytorch#19126",
        "a vocoder's output convolution under weight_norm, its weight initialized to zero",
        Expect("op.division_by_zero", "aten._weight_norm_interface.default", "conv_post", "forward", "nan"),
        "weight_norm computes g * v / ||v|| and ||v|| = 0: 0/0 inside the composite op, in conv_post",
        _weight_norm_zero_init,
    ),
    WildScenario(
        "seg_void_crop_class_weight",
        "holgerroth/3Dunet_abdomen_cascade#3",
        "class-weighted segmentation loss on a crop that holds only the zero-weighted background class",
        Expect("data.no_valid_targets", "aten.nll_loss2d_forward.default", None, "data", "nan"),
        "the weighted mean divides by the total weight of the crop's targets, all of class 0 (weight 0): "
        "the zero comes from the batch's targets, the other classes weigh 1-4",
        _seg_void_crop_class_weight,
    ),
    WildScenario(
        "class_weights_zeroed",
        "zoomin-lee/SemCity#9",
        "cross_entropy with a class-weight tensor that is all zeros",
        Expect("op.division_by_zero", "aten.nll_loss_forward.default", None, "forward", "nan"),
        "every class weighs 0, so the weighted mean is 0 / 0 whatever the targets: the loss code's doing",
        _class_weights_zeroed,
    ),
    WildScenario(
        "spectral_norm_zero_weight",
        "pytorch/pytorch#20192",
        "a critic's output layer under spectral_norm, its weight zeroed",
        Expect("op.division_by_zero", "aten.div.Tensor", "out", "forward", "nan"),
        "sigma = u . W v is 0 for W = 0 whatever eps does in the power iteration; W / sigma is 0/0 in module out",
        _spectral_norm_zero_weight,
    ),
    WildScenario(
        "cosine_sim_zero_embedding",
        "huggingface/sentence-transformers#625",
        "a hand-written cosine similarity over mean word embeddings, one sentence of unknown words only",
        Expect("op.division_by_zero", "aten.div.Tensor", None, "forward", "nan"),
        "the unknown-word sentence embeds to the zero vector: a / ||a|| is 0/0 in the loss code",
        _cosine_sim_zero_embedding,
    ),
    WildScenario(
        "adain_one_element",
        "naoto0804/pytorch-AdaIN#2",
        "adaptive instance normalization on a 1x1 feature map: the unbiased variance over one element",
        Expect("op.division_by_zero", "aten.var.correction", "adain", "forward", "nan"),
        "var over H*W = 1 element with correction 1 divides by n - 1 = 0 (the eps added after it cannot help)",
        _adain_one_element,
    ),
)

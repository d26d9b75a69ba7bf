"""A tiny GPT (nanoGPT-shaped) whose switches reproduce real-world NaN sources.

Every switch defaults to the healthy choice; the fault zoo flips one at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "synthetic_batch"]


@dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    """Token ids are in [0, vocab_size); id 0 is padding."""
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    init_std: float = 0.02
    """Std of Linear and Embedding weights (nanoGPT uses 0.02)."""
    norm_eps: float = 1e-5
    embed_norm: str | None = None
    """Normalize token embeddings before adding positions: None, "layer" or "rms"."""
    naive_softmax: bool = False
    """Attention softmax written as exp(x) / sum(exp(x)), without the max subtraction."""
    loss: str = "cross_entropy"
    """"cross_entropy", "log_softmax_manual" (log of softmax probabilities) or "masked_mean"."""
    logit_scale: float = 1.0
    smooth_reg: float = 0.0
    """Weight of an auxiliary loss on the distance between neighbouring token embeddings,
    written as sqrt(sum(d^2))."""
    vision_dim: int = 0
    """> 0 adds a ``pixel_values`` prefix projected into the sequence (a tiny VLM)."""
    entropy_reg: float = 0.0
    """Weight of an entropy bonus written as -(p * log p).sum() on the output distribution."""
    loss_multiplier: float = 1.0
    """Scales the loss: a loss summed over many tokens instead of averaged, say."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.embed_norm not in (None, "layer", "rms"):
            raise ValueError(f"embed_norm must be None, 'layer' or 'rms', got {self.embed_norm!r}")
        if self.loss not in ("cross_entropy", "log_softmax_manual", "masked_mean"):
            raise ValueError(f"loss must be 'cross_entropy', 'log_softmax_manual' or 'masked_mean', got {self.loss!r}")


class RMSNorm(nn.Module):
    """Hand-written RMSNorm as found in many codebases; eps=0 divides by zero on zero rows."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.naive_softmax = cfg.naive_softmax
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~mask, float("-inf"))
        att = att.exp() / att.exp().sum(-1, keepdim=True) if self.naive_softmax else F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Pre-LN GPT: ``model(input_ids, labels=None, attention_mask=None, ...) -> (logits, loss)``.

    Example:
        >>> model = GPT(GPTConfig())
        >>> logits, loss = model(**synthetic_batch(model.config, torch.Generator()))
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = cfg = config
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd, padding_idx=0)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        if cfg.embed_norm == "layer":
            self.ln_emb: nn.Module = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)
        elif cfg.embed_norm == "rms":
            self.ln_emb = RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        if cfg.vision_dim:
            self.vis_proj = nn.Linear(cfg.vision_dim, cfg.n_embd)
        # A ModuleList; typed as the blocks it holds, which mypy would see as plain Modules.
        self.blocks: list[Block] = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))  # type: ignore[assignment]
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cfg = self.config
        _B, T = input_ids.shape
        tok = self.wte(input_ids)
        aux = None
        if cfg.smooth_reg:
            diff = tok[:, 1:] - tok[:, :-1]
            aux = torch.sqrt((diff * diff).sum(-1)).mean() * cfg.smooth_reg
        if cfg.embed_norm is not None:
            tok = self.ln_emb(tok)
        x = tok + self.wpe(torch.arange(T, device=input_ids.device))
        if pixel_values is not None:
            # Image features join the sequence as a prefix bias on every position.
            x = x + self.vis_proj(pixel_values).mean(1, keepdim=True).to(x.dtype)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask.bool()[:, None, None, :]
        for block in self.blocks:
            x = block(x, mask)
        logits = self.lm_head(self.ln_f(x)) * cfg.logit_scale
        if labels is None:
            return logits, None
        loss = self._loss(logits.float(), labels, loss_mask) * cfg.loss_multiplier
        if cfg.entropy_reg:
            p = F.softmax(logits.float(), dim=-1)
            entropy = -(p * torch.log(p)).sum(-1).mean()
            loss = loss - cfg.entropy_reg * entropy
        return logits, loss if aux is None else loss + aux

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
        flat, target = logits.view(-1, logits.size(-1)), labels.view(-1)
        if self.config.loss == "log_softmax_manual":
            probs = F.softmax(flat, dim=-1)
            return F.nll_loss(torch.log(probs), target, ignore_index=-100)
        if self.config.loss == "masked_mean":
            per_token = F.cross_entropy(flat, target.clamp_min(0), reduction="none")
            weights = loss_mask.reshape(-1).to(per_token.dtype) if loss_mask is not None else (target >= 0).float()
            return (per_token * weights).sum() / weights.sum()
        return F.cross_entropy(flat, target, ignore_index=-100)


def synthetic_batch(cfg: GPTConfig, gen: torch.Generator, batch_size: int = 8) -> dict[str, torch.Tensor]:
    """A learnable toy language: each sequence counts up from a random start, mod vocab."""
    start = torch.randint(1, cfg.vocab_size, (batch_size, 1), generator=gen)
    seq = (start + torch.arange(cfg.block_size + 1)) % (cfg.vocab_size - 1) + 1
    batch = {"input_ids": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous()}
    if cfg.vision_dim:
        batch["pixel_values"] = torch.rand(batch_size, 4, cfg.vision_dim, generator=gen)
    return batch

"""Wild scenarios where top-k / top-p filtering writes -inf in place through a view or an alias of a
policy's logits (see ``nanguard.zoo.wild``), and a healthy twin.

The filtered logits feed an entropy bonus written as ``-(softmax * log_softmax).sum()``: 0 * -inf is NaN
in the forward. The write is the origin, whatever it wrote through (``logits[:, :]``, ``logits.view``,
``logits.data``); before the tracer followed writes through a ``.data`` alias and read a softmax
backward kernel given an Inf gradient as the write's consequence, these were ``unknown`` at
``aten._softmax_backward_data``. Its healthy twin (``safe_entropy_case``) is tested in
``tests/test_diagnosis_round5.py``. Built from these reports (facts only):

- huggingface/transformers#17744: ``top_k_top_p_filtering`` fills the filtered logits with -inf (its
  ``filter_value``) in place, through boolean indexing.
- facebookresearch/metaseq#674: top-p sampling over log-probabilities that were all -inf raised
  "probability tensor contains either inf, nan or element < 0".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanguard.zoo.scenarios import Case, Expect, WildScenario

__all__ = ["SCENARIOS", "safe_entropy_case"]

TOP_K = 3


class FilteredPolicy(nn.Module):
    """A policy whose forward keeps the ``TOP_K`` largest logits of each row, writing -inf into the rest
    in place: through a view (``how="view"``), a ``.data`` alias (``"data"``) or ``scatter_`` into a view."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 12)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.body(x)))
        kth = torch.topk(logits, TOP_K, dim=-1).values[..., -1:]
        if self.how == "view":
            logits[:, :].masked_fill_(logits < kth, float("-inf"))
        elif self.how == "data":
            logits.data[logits.data < kth] = float("-inf")
        else:
            dropped = torch.topk(-logits, logits.shape[-1] - TOP_K, dim=-1).indices
            logits.view(logits.shape).scatter_(1, dropped, float("-inf"))
        return logits


def _entropy_step(how: str, safe: bool = False) -> Case:
    torch.manual_seed(0)
    policy = FilteredPolicy(how)
    x = torch.randn(4, 8)

    def fn(obs: torch.Tensor) -> torch.Tensor:
        policy.zero_grad()
        logits = policy(obs)
        probs, logp = F.softmax(logits, -1), F.log_softmax(logits, -1)
        if safe:  # the filtered entries hold p = 0: their terms are 0, not 0 * -inf
            logp = logp.masked_fill(torch.isinf(logits), 0.0)
        entropy = -(probs * logp).sum(-1).mean()
        loss = -0.01 * entropy
        loss.backward()
        return loss

    return Case(fn, (x,), policy)


def safe_entropy_case() -> Case:
    """The healthy twin (the wild group holds faults only): the same in-place top-k filter through a view, the
    entropy's filtered terms zeroed (p = 0 there, and its log-probability zeroed before the product)."""
    return _entropy_step("view", safe=True)


SCENARIOS = (
    WildScenario(
        "topk_filter_through_a_view",
        "huggingface/transformers#17744",
        "top-k filtering writes -inf in place through a view of the policy's logits; an entropy bonus over them",
        Expect("op.mask_fill_in_loss", "aten.masked_fill_.Scalar", "", "forward", "inf"),
        "the policy's forward fills every logit below the top 3 with -inf through logits[:, :]; the entropy's "
        "softmax * log_softmax is 0 * -inf = NaN there: the fill (in the root module's forward) is the origin",
        lambda: _entropy_step("view"),
    ),
    WildScenario(
        "topk_filter_through_data",
        "huggingface/transformers#17744",
        "top-k filtering writes -inf through logits.data (an alias autograd does not see); an entropy bonus",
        Expect("op.mask_fill_in_loss", "aten.index_put_.default", "", "forward", "inf"),
        "logits.data[mask] = -inf is an index_put_ of -inf into the logits' storage; the entropy's 0 * -inf is NaN",
        lambda: _entropy_step("data"),
    ),
    WildScenario(
        "top_p_scatter_into_a_view",
        "facebookresearch/metaseq#674",
        "filtering writes -inf with scatter_ into a view of the policy's logits; an entropy bonus over them",
        Expect("op.mask_fill_in_loss", "aten.scatter_.value", "", "forward", "inf"),
        "scatter_(1, dropped, -inf) through logits.view(...) fills the dropped logits; the entropy's 0 * -inf is NaN",
        lambda: _entropy_step("scatter"),
    ),
)

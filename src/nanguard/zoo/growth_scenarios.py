"""Runs whose weights grow for hundreds of steps until they overflow, each with a healthy twin.

The size of the weights at the overflow is no init's: the run's history explains it (an LR schedule
run past its end, weight decay with the wrong sign, a hand-written update that grows the weights
x1.2 a step while the loss stays flat). Each is named ``optimizer.divergence`` with the growth in its
evidence (``tests/test_diagnosis_round5.py``); its twin trains the same way with the bug fixed and
must never trip. Built from these reports (facts only):

- huggingface/transformers#132: BertAdam's ``warmup_linear`` schedule gave a negative learning rate
  once the step passed ``t_total`` (set from the number of examples, not of features); fixed in
  huggingface/transformers#327 by clamping at 0.
- chainer/chainer#261 and andersbll/deeppy#17: weight decay applied with the wrong sign; in the
  latter a positive decay made the weights explode.
- luhaofang/tripletloss#53: the weights of the layer before an L2 normalization kept growing with the
  iterations (0.0x to 40.x) until the run went NaN; mp2893/med2vec#6: a weight grown past float32's
  range turned every other weight NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanguard.zoo.gpt import GPT
from nanguard.zoo.scenario import BY_FIRST_BAD, FIRST_BAD, Expect, Scenario

__all__ = ["SCENARIOS"]

Update = Callable[[GPT, torch.optim.Optimizer], None]

WARMUP, TOTAL = 10, 60
"""The schedule warms up for ``WARMUP`` steps and decays linearly to 0 at ``TOTAL``; the run goes on past it."""
DECAY = 4.0
"""The hand-written decay's weight decay: at lr 0.05, lr x wd = 0.2, the matrices change by 20% a step."""
GROWTH = 1.2
"""The hand-written update's growth per step."""
SMALL = {"n_layer": 1, "n_embd": 32, "block_size": 16}
"""A smaller tiny GPT: hundreds of steps each."""


def warmup_linear(step: int) -> float:
    """The LR factor of a warmup-then-linear-decay schedule written without a floor: negative past ``TOTAL``."""
    return step / WARMUP if step < WARMUP else (TOTAL - step) / (TOTAL - WARMUP)


def warmup_linear_clamped(step: int) -> float:
    """The same schedule clamped at 0, as transformers' ``get_linear_schedule_with_warmup`` is."""
    return max(0.0, warmup_linear(step))


def _decay(sign: float) -> Update:
    def decay(model: GPT, optimizer: torch.optim.Optimizer) -> None:
        lr = optimizer.param_groups[0]["lr"]
        for p in model.parameters():
            if p.dim() >= 2:  # matrices decay, biases and norms do not (nanoGPT's groups)
                p.add_(p, alpha=sign * lr * DECAY)  # decoupled: p -= lr * wd * p, with sign -1

    return decay


def _mlp_update(factor: float) -> Update:
    def update(model: GPT, optimizer: torch.optim.Optimizer) -> None:
        # The weights of the first block's MLP feed a LayerNorm downstream: the loss barely sees their scale.
        model.blocks[0].mlp.fc.weight.mul_(factor)

    return update


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "warmup_linear_past_its_end",
        "SGD under a warmup-linear schedule without a floor, run past its end: the LR turns negative, the run "
        "climbs the loss until it overflows",
        Expect("optimizer.divergence", step=BY_FIRST_BAD),
        optimizer="sgd",
        lr=0.5,
        schedule=warmup_linear,
        config=SMALL,
        fault_step=0,
        steps=400,
    ),
    Scenario(
        "weight_decay_wrong_sign",
        "a hand-written decoupled weight decay with its sign flipped (p += lr * wd * p): the matrices grow 20% "
        "a step until they overflow",
        Expect("optimizer.divergence", step=BY_FIRST_BAD),
        schedule=None,
        after_update=_decay(+1.0),
        lr=0.05,
        optimizer="sgd",
        config=SMALL,
        fault_step=0,
        steps=400,
    ),
    Scenario(
        "update_grows_weights_slowly",
        "a hand-written update that scales an MLP's weights x1.2 a step while a LayerNorm keeps the loss flat: "
        "never tenfold within a few steps, overflowing after a few hundred",
        Expect("optimizer.divergence", step=FIRST_BAD),
        after_update=_mlp_update(GROWTH),
        config=SMALL,
        fault_step=0,
        steps=400,
    ),
    Scenario(
        "healthy_warmup_linear_clamped",
        "the same schedule clamped at 0, run as long: must not trip",
        Expect(None),
        optimizer="sgd",
        lr=0.5,
        schedule=warmup_linear_clamped,
        config=SMALL,
        fault_step=0,
        steps=400,
    ),
    Scenario(
        "healthy_weight_decay",
        "the same hand-written decoupled weight decay with the right sign: must not trip",
        Expect(None),
        after_update=_decay(-1.0),
        lr=0.05,
        optimizer="sgd",
        config=SMALL,
        fault_step=0,
        steps=400,
    ),
    Scenario(
        "healthy_update_shrinks_weights",
        "the same hand-written update shrinking the weights by 0.1% a step: must not trip",
        Expect(None),
        after_update=_mlp_update(0.999),
        config=SMALL,
        fault_step=0,
        steps=400,
    ),
)

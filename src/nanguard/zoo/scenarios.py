"""The fault zoo: realistic ways a run goes NaN, each with the diagnosis it must get.

A scenario builds the tiny GPT, trains it on synthetic data, and at ``fault_step`` applies
its fault (to the batch or the model) the way it happens in real runs. ``expect`` states
the cause, op, module, phase and kind nanguard must report, or ``cause=None`` for a healthy
run that must never trip.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanguard.zoo.dist_scenarios import EDGE_SCENARIOS
from nanguard.zoo.gpt import GPT
from nanguard.zoo.growth_scenarios import SCENARIOS as GROWTH_SCENARIOS
from nanguard.zoo.scenario import (
    BY_FIRST_BAD,
    FIRST_BAD,
    Batch,
    Case,
    Expect,
    Run,
    Scenario,
    WildScenario,
    build,
    train_step,
)

__all__ = [
    "BY_FIRST_BAD",
    "FIRST_BAD",
    "SCENARIOS",
    "Case",
    "Expect",
    "Run",
    "Scenario",
    "WildScenario",
    "build",
    "get",
    "train_step",
]


def _drift_ln_gain(gain: float) -> Callable[[GPT, Batch], Batch]:
    """A LayerNorm gain that grew during training scales everything after it."""

    def fault(model: GPT, batch: Batch) -> Batch:
        with torch.no_grad():
            model.blocks[0].ln_1.weight.fill_(gain)
        return batch

    return fault


def _pad_tail(batch: Batch, rows: int = 2) -> Batch:
    """Right-pad the last ``rows`` samples: half of their tokens become padding (id 0)."""
    ids = batch["input_ids"].clone()
    ids[-rows:, ids.shape[1] // 2 :] = 0
    return {**batch, "input_ids": ids}


def _fully_masked_sample(model: GPT, batch: Batch) -> Batch:
    mask = torch.ones_like(batch["input_ids"])
    mask[-1] = 0  # an all-padding sample left in the batch by the collator
    return {**batch, "attention_mask": mask}


def _all_ignored(model: GPT, batch: Batch) -> Batch:
    return {**batch, "labels": torch.full_like(batch["labels"], -100)}


def _pad_tokens(model: GPT, batch: Batch) -> Batch:
    return _pad_tail(batch)


def _repeated_token(model: GPT, batch: Batch) -> Batch:
    ids = batch["input_ids"].clone()
    ids[0, 5] = ids[0, 4]  # "the the": zero distance between neighbours
    return {**batch, "input_ids": ids}


def _logit_scale(model: GPT, batch: Batch) -> Batch:
    model.config.logit_scale = 2000.0  # a learned temperature that ran away
    return batch


def _nan_pixels(model: GPT, batch: Batch) -> Batch:
    pixels = batch["pixel_values"].clone()
    pixels[2, 1, :5] = float("nan")  # a corrupt image: 0/0 in the per-image normalization
    return {**batch, "pixel_values": pixels}


def _token_past_vocab(model: GPT, batch: Batch) -> Batch:
    ids = batch["input_ids"].clone()
    ids[1, 7] = model.config.vocab_size  # a tokenizer with one more special token than the model
    return {**batch, "input_ids": ids}


def _label_past_vocab(model: GPT, batch: Batch) -> Batch:
    labels = batch["labels"].clone()
    labels[0, 3] = model.config.vocab_size + 4
    return {**batch, "labels": labels}


def _nan_weight(model: GPT, batch: Batch) -> Batch:
    with torch.no_grad():
        model.blocks[1].mlp.fc.weight[3, 5] = float("nan")  # a corrupt checkpoint shard
    return batch


def _nan_padding_row_checkpoint(model: GPT, batch: Batch) -> Batch:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["wte.weight"][0] = float("nan")  # the padding row (padding_idx=0): no batch reads it
    model.load_state_dict(state)  # as a resumed run loads its checkpoint
    return batch


def _empty_loss_mask(model: GPT, batch: Batch) -> Batch:
    return {**batch, "loss_mask": torch.zeros_like(batch["labels"])}


def _inf_pixels(model: GPT, batch: Batch) -> Batch:
    pixels = batch["pixel_values"].clone()
    pixels[0, 0, 3] = float("inf")  # an overflowing uint16 -> float16 decode
    return {**batch, "pixel_values": pixels}


def _mask_tail(model: GPT, batch: Batch) -> Batch:
    mask = torch.ones_like(batch["input_ids"])
    mask[:, -5:] = 0  # right padding: every sample keeps real tokens
    return {**batch, "attention_mask": mask}


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "fp16_attention_overflow",
        "float16 model whose drifted LayerNorm gain pushes q @ k^T past 65504",
        Expect("precision.overflow", "aten.bmm.default", "blocks.0.attn", "forward", "inf"),
        dtype=torch.float16,
        fault=_drift_ln_gain(1000.0),
        fault_step=0,
    ),
    Scenario(
        "padding_fully_masked",
        "an all-padding sample: every key of its rows is masked with -inf",
        Expect("op.masked_softmax", "aten._softmax.default", "blocks.0.attn", "forward", "nan"),
        fault=_fully_masked_sample,
    ),
    Scenario(
        "all_labels_ignored",
        "every label is -100 (a sample cut to its prompt): cross-entropy mean is 0/0",
        Expect("data.no_valid_targets", "aten.nll_loss_forward.default", "", "data", "nan"),
        fault=_all_ignored,
    ),
    Scenario(
        "layernorm_eps0_constant",
        "LayerNorm(eps=0) on token embeddings; padding rows are constant zeros",
        Expect("norm.zero_variance", "aten.native_layer_norm.default", "ln_emb", "forward", "nan"),
        config={"embed_norm": "layer", "norm_eps": 0.0},
        fault=_pad_tokens,
    ),
    Scenario(
        "rmsnorm_no_eps",
        "hand-written RMSNorm without eps on zero (padding) embeddings",
        Expect("norm.zero_variance", "aten.rsqrt.default", "ln_emb", "forward", "inf"),
        config={"embed_norm": "rms", "norm_eps": 0.0},
        fault=_pad_tokens,
    ),
    Scenario(
        "log_of_probabilities",
        "loss = nll(log(softmax(logits))): a confident wrong token has probability 0",
        Expect("op.log_domain", "aten.log.default", "", "forward", "inf"),
        config={"loss": "log_softmax_manual"},
        fault=_logit_scale,
    ),
    Scenario(
        "softmax_without_max",
        "attention softmax written as exp(x)/sum(exp(x)); scores grow past 88.7",
        Expect("op.exp_overflow", "aten.exp.default", "blocks.0.attn", "forward", "inf"),
        config={"naive_softmax": True},
        fault=_drift_ln_gain(300.0),
    ),
    Scenario(
        "sqrt_grad_at_zero",
        "a smoothness loss sqrt(sum((e[t+1] - e[t])^2)) on a batch with a repeated token",
        Expect("op.sqrt_domain", "aten.div.Tensor", "", "backward", "inf"),
        config={"smooth_reg": 0.01},
        fault=_repeated_token,
    ),
    Scenario(
        "nan_pixels",
        "a corrupt image: NaN pixels in pixel_values",
        Expect("data.nonfinite", None, "vis_proj", "data", "nan"),
        config={"vision_dim": 16},
        fault=_nan_pixels,
    ),
    Scenario(
        "token_id_out_of_range",
        "a token id equal to vocab_size (tokenizer and embedding disagree)",
        Expect("data.index_out_of_range", "aten.embedding.default", "wte", "data", "invalid"),
        fault=_token_past_vocab,
    ),
    Scenario(
        "label_out_of_range",
        "a label id past the vocabulary",
        Expect("data.index_out_of_range", "aten.nll_loss_forward.default", "", "data", "invalid"),
        fault=_label_past_vocab,
    ),
    Scenario(
        "nan_weight",
        "a NaN in one weight, as loaded from a corrupt checkpoint shard",
        Expect("parameters.nonfinite", None, "blocks.1.mlp.fc", "parameters", "nan"),
        fault=_nan_weight,
    ),
    Scenario(
        "checkpoint_nan_unused_row",
        "a checkpoint whose embedding padding row is NaN: no batch reads it, so no loss or gradient shows it",
        Expect("parameters.nonfinite", None, "wte", "parameters", "nan", step=0),
        fault=_nan_padding_row_checkpoint,
        fault_step=0,
        steps=3,
    ),
    # The init is the upstream fault, but float32 computes this q @ k^T finitely (absmax ~1e6):
    # by the causes' definitions the float16 overflow is precision.overflow, and the weight
    # scale is the secondary cause in diag.also (tests/test_zoo.py checks it is there).
    Scenario(
        "huge_init",
        "float16 model initialized with std=20 (a gain passed as the std): q @ k^T overflows float16",
        Expect("precision.overflow", "aten.bmm.default", "blocks.0.attn", "forward", "inf"),
        config={"init_std": 20.0},
        dtype=torch.float16,
        fault_step=0,
    ),
    Scenario(
        "masked_mean_zero_count",
        "loss = sum(loss * mask) / mask.sum() on a batch whose loss mask is empty",
        # The batch's mask selects nothing: the zero count is the data's (as in the wild group's
        # empty_mask_masked_mean), found where the masked mean divides.
        Expect("data.no_valid_targets", "aten.div.Tensor", "", "data", "nan"),
        config={"loss": "masked_mean"},
        fault=_empty_loss_mask,
    ),
    Scenario(
        "inf_pixels",
        "an image decoded with an overflow: +Inf in pixel_values",
        Expect("data.nonfinite", None, "vis_proj", "data", "inf"),
        config={"vision_dim": 16},
        fault=_inf_pixels,
    ),
    Scenario(
        "entropy_bonus_p_log_p",
        "an entropy bonus -(p * log p) where a probability underflows to 0",
        Expect("op.log_domain", "aten.log.default", "", "forward", "inf"),
        config={"entropy_reg": 0.01},
        fault=_logit_scale,
    ),
    # Which op, module, phase and kind overflow first in a divergence, and at which step, depend
    # on the seed and the thread count, not on the fault: expected is only the cause, detected
    # at the step a plain run first goes non-finite.
    Scenario(
        "lr_too_high",
        "SGD at lr=50: the loss and grad norm grow for a few steps, then overflow",
        Expect("optimizer.divergence", step=FIRST_BAD),
        optimizer="sgd",
        lr=50.0,
        fault_step=0,
        steps=10,
    ),
    # One AdamW update moves every weight by about lr: the next forward's residual stream is so
    # large that a LayerNorm's variance overflows float32 (Inf, not zero). The history holds one
    # step, so the weights' growth from the run's start is the evidence of divergence.
    # SGD's update is lr x gradient: the grad norm grows ~1e15-fold in four steps, and by step 4 or 5
    # the run leaves float32's range. Whether it leaves as finite gradients past 1.8e19 (whose float32
    # norm is Inf: a clip's), as an Inf in that step's forward, or a step later, depends on the
    # CPU's rounding (weights perturbed by 1e-6 of themselves, another seed, or another CPU's kernels
    # move it), not on the fault: expected is only the cause, at the step a plain run first goes
    # non-finite. The finite-gradient trip itself is pinned by construction in
    # tests/test_loop_faults.py (a loss summed over 1e20 terms).
    Scenario(
        "sgd_lr_huge_finite_gradients",
        "SGD at lr=200: the grad norm grows ~1e15x in four steps, then leaves float32's range",
        Expect("optimizer.divergence", step=FIRST_BAD),
        optimizer="sgd",
        lr=200.0,
        fault_step=0,
        steps=8,
    ),
    Scenario(
        "adamw_lr_exponent_typo",
        "AdamW at lr=1e6 (1e-6 typed without its minus): a LayerNorm's input variance overflows to Inf",
        Expect("optimizer.divergence", step=FIRST_BAD),
        lr=1e6,
        fault_step=0,
        steps=3,
    ),
    Scenario(
        "fp16_adamw_default_eps",
        "a float16 model with AdamW's default eps=1e-8, which is 0 in float16: 0/0 on the padding row",
        Expect("optimizer.nonfinite_update", "AdamW.step", "wte", "optimizer", "nan", step=0),
        dtype=torch.float16,
        fault_step=0,
        steps=3,
    ),
    Scenario(
        "adam_eps_zero",
        "Adam with eps=0: the padding row's zero gradient gives 0/0 in the update",
        Expect("optimizer.nonfinite_update", "Adam.step", "wte", "optimizer", "nan", step=0),
        optimizer="adam_eps0",
        fault_step=0,
        steps=3,
    ),
    Scenario(
        "gradscaler_collapse",
        "float16 autocast with a loss summed (x1e12) instead of averaged: every scale overflows",
        Expect("precision.loss_scale", None, None, "backward", "inf", step=19),
        config={"loss_multiplier": 1e12},
        amp=True,
        fault_step=0,
        steps=24,
    ),
    Scenario(
        "rank_local_bad_data",
        "2 ranks under DDP; rank 1's image batch holds NaN pixels",
        Expect("data.nonfinite", None, "vis_proj", "data", "nan", rank=1, ranks=(1,)),
        config={"vision_dim": 16},
        fault=_nan_pixels,
        ranks=2,
        dist_fault="data",
    ),
    Scenario(
        "transient_comm_corruption",
        "2 ranks under DDP; the all-reduced gradients are corrupted once in transit",
        Expect("distributed.transient", None, None, "communication", "nan"),
        ranks=2,
        dist_fault="comm",
    ),
    Scenario(
        "replica_divergence",
        "2 ranks under DDP; rank 1 changes a weight in place, behind DDP's back",
        Expect("distributed.replica_divergence", None, "blocks.1.mlp.fc", "parameters", "invalid", rank=1, ranks=(1,)),
        ranks=2,
        dist_fault="replica",
    ),
    Scenario(
        "healthy_padding_mask",
        "causal -inf mask plus right padding: legitimately masked, must not trip",
        Expect(None),
        fault=_mask_tail,
    ),
    Scenario(
        "healthy_bf16_large_activations",
        "bfloat16 model with the activations that overflow float16: must not trip",
        Expect(None),
        dtype=torch.bfloat16,
        fault=_drift_ln_gain(1000.0),
    ),
)

SCENARIOS += EDGE_SCENARIOS + GROWTH_SCENARIOS


def get(name: str) -> Scenario:
    for scenario in SCENARIOS:
        if scenario.name == name:
            return scenario
    names = ", ".join(s.name for s in SCENARIOS)
    raise ValueError(f"unknown scenario {name!r}; choose one of: {names}")

"""The fault zoo: a tiny GPT and realistic ways to make it go NaN."""

from nanguard.zoo.gpt import GPT, GPTConfig, synthetic_batch
from nanguard.zoo.scenarios import SCENARIOS, Expect, Run, Scenario, build, get, train_step

__all__ = [
    "GPT",
    "SCENARIOS",
    "Expect",
    "GPTConfig",
    "Run",
    "Scenario",
    "build",
    "get",
    "synthetic_batch",
    "train_step",
]

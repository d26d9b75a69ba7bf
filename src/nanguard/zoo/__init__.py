"""The fault zoo: a tiny GPT and realistic ways to make it go NaN."""

import os

from nanguard.tracer.modules import count_as_user_code
from nanguard.zoo.gpt import GPT, GPTConfig, synthetic_batch
from nanguard.zoo.scenarios import SCENARIOS, Expect, Run, Scenario, WildScenario, build, get, train_step

# The zoo's models and training steps are user-style code: a diagnosis points at their lines.
count_as_user_code(os.path.dirname(__file__))

__all__ = [
    "GPT",
    "SCENARIOS",
    "Expect",
    "GPTConfig",
    "Run",
    "Scenario",
    "WildScenario",
    "build",
    "get",
    "synthetic_batch",
    "train_step",
]

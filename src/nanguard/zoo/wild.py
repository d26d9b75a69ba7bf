"""The zoo's "wild" group: NaN bugs reported in public issue trackers, rebuilt small.

Each scenario is one faulty step of code nobody here wrote (a loss, a model, a training
step from the report), run through ``ng.locate``. ``expect`` is derived from the fault as
the report describes it (which op makes the first non-finite value, in which module, and
why), never from nanguard's output; ``basis`` says what it rests on. The cases live in
``wild_losses`` (loss and training-step code), ``wild_models`` (model code),
``wild_masks`` (masks, fills and writes), ``wild_norms`` (normalizations and divisions inside
composite ops), ``wild_raises`` (torch's own NaN results, gradient surgery, NaNs that surface
as a raise), ``wild_domains`` (infinities meeting infinities, the log family), ``wild_surgery``
(gradient surgery on what ``torch.autograd.grad`` returned), ``wild_samples`` (the sample
behind a masked row), ``wild_replays`` (steps that draw from ``random``/``numpy.random``) and
``wild_compiled`` (a compiled submodule that miscompiles), ``wild_causes`` (causes no other group
expects), ``wild_views`` (-inf written through a view or an alias of a policy's logits).
"""

from __future__ import annotations

from nanguard.zoo import (
    wild_causes,
    wild_compiled,
    wild_domains,
    wild_losses,
    wild_masks,
    wild_models,
    wild_norms,
    wild_raises,
    wild_replays,
    wild_samples,
    wild_surgery,
    wild_views,
)
from nanguard.zoo.scenarios import WildScenario

__all__ = ["WILD", "get_wild"]


WILD: tuple[WildScenario, ...] = (
    *wild_losses.SCENARIOS,
    *wild_models.SCENARIOS,
    *wild_masks.SCENARIOS,
    *wild_norms.SCENARIOS,
    *wild_raises.SCENARIOS,
    *wild_domains.SCENARIOS,
    *wild_surgery.SCENARIOS,
    *wild_samples.SCENARIOS,
    *wild_replays.SCENARIOS,
    *wild_compiled.SCENARIOS,
    *wild_causes.SCENARIOS,
    *wild_views.SCENARIOS,
)


def get_wild(name: str) -> WildScenario:
    for scenario in WILD:
        if scenario.name == name:
            return scenario
    names = ", ".join(s.name for s in WILD)
    raise ValueError(f"unknown wild scenario {name!r}; choose one of: {names}")

"""Every entry point takes ``ng.Guard``'s options the same way, and the first trip of a run shows the
whole diagnosis whatever the entry point (later trips one line)."""

from __future__ import annotations

import pytest
import torch

from nanguard.integrations import guard_options
from nanguard.integrations.loop import LoopGuard
from nanguard.zoo import GPT, GPTConfig, synthetic_batch

CONFIG = GPTConfig(vision_dim=16, n_embd=32, block_size=16)


def _setup() -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _loop(model: GPT, optimizer: torch.optim.Optimizer, steps: int, bad: set[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        b = synthetic_batch(CONFIG, gen, batch_size=4)
        if step in bad:
            b["pixel_values"][0, 0, 0] = float("nan")
        _, loss = model(b["input_ids"], labels=b["labels"], pixel_values=b["pixel_values"])
        loss.backward()
        optimizer.step()


def test_loop_guard_takes_on_event_as_guard_does() -> None:
    events: list[dict] = []
    model, opt = _setup()
    with LoopGuard(model, opt, policy="skip", on_event=events.append, inject=None):
        _loop(model, opt, 3, bad={1})
    kinds = [e["kind"] for e in events]
    assert "trip" in kinds and kinds.count("step") >= 2


def test_every_entry_point_accepts_and_refuses_the_same_options() -> None:
    for ok in ({"on_event": print}, {"inject": "nan_grad@step=3"}, {"max_consecutive_skips": 5}, {}):
        guard_options("skip", ok)
    with pytest.raises(ValueError, match=r"unknown Guard option\(s\) \['on_evnt'\]; accepted: .*'on_event'"):
        guard_options("skip", {"on_evnt": print})
    with pytest.raises(ValueError, match="on_event must be None or a callable"):
        guard_options("skip", {"on_event": "tb"})
    model, opt = _setup()
    with pytest.raises(ValueError, match="on_evnt"):
        LoopGuard(model, opt, on_evnt=print)


def test_framework_callbacks_take_on_event() -> None:
    pytest.importorskip("lightning")
    from nanguard.integrations.hf import NanGuardCallback
    from nanguard.integrations.lightning import NanGuard

    events: list[dict] = []
    assert NanGuard(on_event=events.append).options["on_event"] == events.append
    hf = NanGuardCallback(on_event=events.append, max_consecutive_skips=4)
    assert hf.state()["args"] == {"policy": "skip", "run_dir": None, "max_consecutive_skips": 4}


def test_dir_of_nanguard_is_its_public_api() -> None:
    import nanguard as ng

    ng.Guard  # noqa: B018 - loads submodules, which must not show either
    assert dir(ng) == sorted([*ng.__all__, "__version__"])
    for private in ("Any", "TYPE_CHECKING", "annotations", "importlib", "guard", "findings"):
        assert private not in dir(ng), private


def _trip_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "nanguard" and " -> " in r.getMessage()]


def _closure_guard_run(bad: set[int]) -> None:
    import nanguard as ng

    model, opt = _setup()
    guard = ng.Guard(model, opt, policy="skip")
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        b = synthetic_batch(CONFIG, gen, batch_size=4)
        if step in bad:
            b["pixel_values"][0, 0, 0] = float("nan")

        def closure(b: dict = b) -> torch.Tensor:
            opt.zero_grad()
            _, loss = model(b["input_ids"], labels=b["labels"], pixel_values=b["pixel_values"])
            loss.backward()
            return loss

        guard.step(closure, batch=b)


@pytest.mark.parametrize("entry", ["Guard.step", "LoopGuard"])
def test_the_first_trip_is_told_whole_and_later_ones_in_a_line(entry: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="nanguard")
    if entry == "Guard.step":
        _closure_guard_run(bad={1, 2})
    else:
        model, opt = _setup()
        with LoopGuard(model, opt, policy="skip"):
            _loop(model, opt, 4, bad={1, 2})
    first, *later = _trip_records(caplog)
    assert len(later) == 1, later  # one record per trip: no entry point tells it twice
    assert first.startswith("nanguard: step 1: data.nonfinite") and first.endswith("-> skip") is False
    for part in ("data.nonfinite", "your code", "phase", "try "):
        assert part in first, part
    assert later[0].startswith("nanguard: step 2: data.nonfinite") and "\n" not in later[0]
    # The first replay says it runs and how long it took (a big model's pause is not silent); later ones do not.
    news = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "replay" in r.getMessage()]
    assert news[0] == "nanguard: replaying step 1 under the tracer…" and news[1].startswith(
        "nanguard: replayed step 1 in "
    )
    assert not [m for m in news if "step 2" in m]


def test_guard_options_are_keywords_of_its_own_with_docs() -> None:
    import inspect
    import pydoc
    from dataclasses import fields

    import nanguard as ng
    from nanguard.guard import GuardConfig

    params = inspect.signature(ng.Guard).parameters
    defaults = GuardConfig()
    for f in fields(GuardConfig):
        assert f.name in params, f"GuardConfig.{f.name} is not a keyword of Guard: add it to Guard.__init__"
        assert params[f.name].default == getattr(defaults, f.name), f.name
        assert f"{f.name}" in (ng.Guard.__doc__ or ""), f"Guard's docstring does not document {f.name}"
    shown = pydoc.render_doc(ng.Guard, renderer=pydoc.plaintext)
    assert "max_consecutive_skips: 'int' = 10" in shown and "clip_grad_norm:" in shown
    model, opt = _setup()
    with pytest.raises(
        ValueError, match=r"unknown Guard option\(s\) \['max_skips'\]; accepted: .*max_consecutive_skips"
    ):
        ng.Guard(model, opt, max_skips=3)
    guard = ng.Guard(model, opt, "rollback", snapshot_every=7, clip_grad_norm=1.0)
    assert (guard.config.policy, guard.config.snapshot_every, guard.config.clip_grad_norm) == ("rollback", 7, 1.0)

"""The fault zoo under the guard: every expectation holds, at the step the fault appears."""

import json

import pytest
import torch

import nanguard as ng
from nanguard.cli import main
from nanguard.zoo import SCENARIOS, build, get
from nanguard.zoo.runner import run_distributed, run_scenario, run_wild
from nanguard.zoo.scenarios import BY_FIRST_BAD
from nanguard.zoo.wild import WILD

# Runs that grow for hundreds of steps (nanguard.zoo.growth_scenarios) are slow on a loaded CPU: they run
# under -m slow; their short variants on a small MLP always run (tests/test_diagnosis_round5.py).
LONG = 100
SINGLE = [pytest.param(s, marks=pytest.mark.slow) if s.run_steps > LONG else s for s in SCENARIOS if s.ranks == 1]
DIST = [s for s in SCENARIOS if s.ranks > 1]


# A wild scenario that needs the provenance of a denominator (a count of the batch's labels):
# known to miss today, named in the closing note of issue 11.
# Causes no zoo scenario can expect, and why: a check_batch finding rejects the batch before any
# step runs (Guard(check_batch=True), tests/test_diagnosis_round4.py; in a traced step the same fault
# is op.masked_softmax with data.fully_masked among diag.also); a step that does not reproduce, or a
# faulty device, is by definition not a fault one replayed step shows; "unknown" is no expectation.
NOT_ONE_STEP = {"data.fully_masked", "data.invalid_mask", "step.not_reproduced", "hardware.faulty_device", "unknown"}


def test_every_cause_has_a_zoo_scenario_or_a_stated_reason() -> None:
    covered = {s.expect.cause for s in SCENARIOS} | {s.expect.cause for s in WILD}
    assert set(ng.CAUSES) - covered == NOT_ONE_STEP - covered
    assert set(ng.CAUSES) >= NOT_ONE_STEP


def test_the_zoo_is_big_enough_and_covers_every_one_step_cause() -> None:
    assert len(SCENARIOS) >= 24
    assert len({s.name for s in SCENARIOS}) == len(SCENARIOS)
    causes = {s.expect.cause for s in SCENARIOS} | {s.expect.cause for s in WILD}  # the zoo's two groups
    for cause in (
        "data.nonfinite",
        "data.index_out_of_range",
        "data.no_valid_targets",
        "parameters.nonfinite",
        "op.log_domain",
        "op.sqrt_domain",
        "op.division_by_zero",
        "op.exp_overflow",
        "op.masked_softmax",
        "norm.zero_variance",
        "precision.overflow",
        "precision.loss_scale",
        "optimizer.divergence",
        "optimizer.nonfinite_update",
        "init.scale",
        "op.trig_domain",
        "op.mask_fill_in_loss",
        "op.nan_write",
        "compile.numerics",
        "distributed.transient",
        "distributed.replica_divergence",
        None,
    ):
        assert cause in causes, cause


@pytest.mark.parametrize("scenario", SINGLE, ids=lambda s: s.name)
def test_single_rank_scenario(scenario) -> None:
    result = run_scenario(scenario)
    assert result.ok, result.to_dict()
    if scenario.expect.cause is not None and result.first_bad_step is not None:
        assert result.steps_late == 0 or (scenario.expect.step == BY_FIRST_BAD and result.steps_late < 0)


@pytest.mark.dist
@pytest.mark.parametrize("scenario", DIST, ids=lambda s: s.name)
def test_distributed_scenario(scenario) -> None:
    result = run_distributed(scenario)
    assert result.ranks_agree and result.ok, result.to_dict()


def test_zoo_cli_json_parses(capsys) -> None:
    code = main(["zoo", "--only", "nan_weight", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["total"] == 1 and data["misses"] == 0
    (row,) = data["results"]
    assert row["got"]["cause"] == "parameters.nonfinite" and row["ok"] is True


def test_zoo_cli_rejects_an_unknown_scenario(capsys) -> None:
    with pytest.raises(SystemExit) as err:
        main(["zoo", "--only", "no_such_fault"])
    assert err.value.code == 2 and "unknown scenario 'no_such_fault'" in capsys.readouterr().err


def test_the_wild_group_is_big_enough_and_names_its_reports() -> None:
    assert len(WILD) >= 14
    names = [s.name for s in WILD] + [s.name for s in SCENARIOS]
    assert len(set(names)) == len(names)
    for s in WILD:
        owner, _, number = s.source.partition("#")
        assert "/" in owner and number.isdigit(), s.source
        assert s.expect.cause is not None and s.basis, s.name


@pytest.mark.parametrize("scenario", WILD, ids=lambda s: s.name)
def test_wild_scenario(scenario) -> None:
    result = run_wild(scenario)
    assert result.first_bad_step == 0, "the plain step must go non-finite: the fault is real"
    assert result.ok, result.to_dict()


def test_huge_init_keeps_the_weight_scale_as_a_secondary_cause() -> None:
    run = build(get("huge_init"))
    diag = ng.locate(run.closure(run.batch(0)), model=run.model)
    assert diag is not None and diag.cause == "precision.overflow"
    assert diag.evidence["origin"]["fp32_recompute"]["finite"] is True
    assert "init.scale" in [a["cause"] for a in diag.also]


def test_zoo_cli_runs_a_wild_scenario_with_its_group(capsys) -> None:
    code = main(["zoo", "--group", "wild", "--only", "ppo_std_one_sample", "--json"])
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert code == 0 and row["group"] == "wild" and row["got"]["cause"] == "op.division_by_zero"


def test_zoo_rejects_an_unknown_group() -> None:
    from nanguard.zoo.runner import run_zoo

    with pytest.raises(ValueError, match="group must be one of"):
        run_zoo(group="tame", as_json=True)


# A scenario's expected fields must follow from its fault, not from the CPU's rounding: weights
# moved by a relative 1e-6 (as little as another CPU's kernels move a run that diverges for a few
# steps) must leave every expected field as it is. The search (docs/guarantees.md) found one
# scenario that failed so: it expected the phase and kind of the first overflow of a divergence.
@pytest.mark.parametrize("name", ["sgd_lr_huge_finite_gradients"])
def test_a_divergence_scenario_expects_nothing_the_cpu_rounding_decides(name, monkeypatch) -> None:
    import nanguard.zoo.runner as runner

    def perturbed(s, seed=0, **kwargs):
        run = build(s, seed, **kwargs)
        gen = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for p in run.model.parameters():
                p.mul_(1 + 1e-6 * (2 * torch.rand(p.shape, generator=gen) - 1).to(p.dtype))
        return run

    monkeypatch.setattr(runner, "build", perturbed)
    result = run_scenario(get(name))
    assert result.ok and result.steps_late == 0, result.to_dict()

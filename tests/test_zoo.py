"""The fault zoo under the guard: every expectation holds, at the step the fault appears."""

import json

import pytest

from nanguard.cli import main
from nanguard.zoo import SCENARIOS
from nanguard.zoo.runner import run_distributed, run_scenario

SINGLE = [s for s in SCENARIOS if s.ranks == 1]
DIST = [s for s in SCENARIOS if s.ranks > 1]


def test_the_zoo_is_big_enough_and_covers_every_one_step_cause() -> None:
    assert len(SCENARIOS) >= 24
    assert len({s.name for s in SCENARIOS}) == len(SCENARIOS)
    causes = {s.expect.cause for s in SCENARIOS}
    for cause in ("data.nonfinite", "data.index_out_of_range", "data.no_valid_targets", "parameters.nonfinite",
                  "op.log_domain", "op.sqrt_domain", "op.division_by_zero", "op.exp_overflow", "op.masked_softmax",
                  "norm.zero_variance", "precision.overflow", "precision.loss_scale", "optimizer.divergence",
                  "optimizer.nonfinite_update", "init.scale", "distributed.transient",
                  "distributed.replica_divergence", None):  # fmt: skip
        assert cause in causes, cause


@pytest.mark.parametrize("scenario", SINGLE, ids=lambda s: s.name)
def test_single_rank_scenario(scenario) -> None:
    result = run_scenario(scenario)
    assert result.ok, result.to_dict()
    if scenario.expect.cause is not None and result.first_bad_step is not None:
        assert result.steps_late == 0


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

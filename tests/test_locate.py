"""locate on the fault zoo, on healthy models, and its robustness guarantees."""

from collections import OrderedDict
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_mod
from torch.utils._python_dispatch import _get_current_dispatch_mode

import nanguard as ng
from nanguard.zoo import SCENARIOS, build, train_step


def _locate_scenario(scenario):
    run = build(scenario)
    for _, batch in run.batches(scenario.fault_step):
        train_step(run.model, batch)
        run.optimizer.step()
    batch = run.batch(scenario.fault_step)
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    diag = ng.locate(train_step, run.model, batch, model=run.model)
    after = run.model.state_dict()
    assert all(torch.equal(before[k].nan_to_num(), after[k].nan_to_num()) for k in before)
    return diag


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.expect.cause and s.one_step], ids=lambda s: s.name)
def test_zoo_fault_is_located_and_named(scenario) -> None:
    diag = _locate_scenario(scenario)
    e = scenario.expect
    assert diag is not None, "the fault went unnoticed"
    assert (diag.cause, diag.op, diag.module, diag.phase, diag.kind) == (e.cause, e.op, e.module, e.phase, e.kind)
    assert diag.fixes and diag.evidence["why"]
    assert diag.rank is None and diag.ranks == []


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if not s.expect.cause], ids=lambda s: s.name)
def test_healthy_zoo_runs_return_none(scenario) -> None:
    assert _locate_scenario(scenario) is None


def test_evidence_holds_origin_statistics_and_the_ops_before() -> None:
    diag = _locate_scenario(next(s for s in SCENARIOS if s.name == "log_of_probabilities"))
    origin = diag.evidence["origin"]
    (x,) = origin["inputs"]
    assert x["zeros"] > 0 and x["dtype"] == "float32" and x["nan"] == 0
    assert origin["outputs"][0]["neginf"] == x["zeros"]
    assert diag.evidence["before"][-1]["op"] == "aten._softmax.default"
    assert diag.source and diag.source.split(":")[0].endswith("gpt.py")
    assert any(step["op"] for step in diag.evidence["after"])


def test_precision_origin_is_recomputed_in_float32() -> None:
    diag = _locate_scenario(next(s for s in SCENARIOS if s.name == "fp16_attention_overflow"))
    ref = diag.evidence["origin"]["fp32_recompute"]
    assert ref["finite"] is True and ref["absmax"] > ref["dtype_max"] == 65504.0


def test_backward_origin_names_the_autograd_node_and_forward_line() -> None:
    x = torch.zeros(3, requires_grad=True)

    def fn():
        y = torch.sqrt(x * x)  # the user's line
        y.sum().backward()
        return y.sum()

    diag = ng.locate(fn)
    assert diag.cause == "op.sqrt_domain" and diag.phase == "backward"
    assert diag.evidence["origin"]["node"] == "SqrtBackward0"
    assert diag.evidence["origin"]["forward_op"] == "aten.sqrt.default"
    assert diag.source.endswith(f"test_locate.py:{fn.__code__.co_firstlineno + 1}")


def test_data_path_is_named_for_nested_inputs() -> None:
    model = nn.Linear(4, 2)
    batch = {"images": [torch.zeros(2, 4), torch.ones(2, 4)], "meta": {"scale": torch.ones(2)}}
    batch["images"][1][0, 2] = float("inf")

    def step(batch):
        return model(batch["images"][1]).sum() * batch["meta"]["scale"].sum()

    diag = ng.locate(step, batch, model=model)
    assert diag.cause == "data.nonfinite" and diag.phase == "data" and diag.kind == "inf"
    assert diag.evidence["origin"]["path"] == "batch['images'][1]"
    assert diag.module == ""


def test_intentional_neg_inf_mask_in_the_data_is_not_an_origin() -> None:
    scores = torch.randn(2, 4)
    mask = torch.zeros(2, 4)
    mask[:, 2:] = float("-inf")
    assert ng.locate(lambda s, m: F.softmax(s + m, -1).sum(), scores, mask) is None
    mask[1] = float("-inf")  # a fully masked row: the softmax creates the NaN
    diag = ng.locate(lambda s, m: F.softmax(s + m, -1).sum(), scores, mask)
    assert diag.cause == "op.masked_softmax" and diag.op == "aten._softmax.default"


class _Output(OrderedDict):
    """A ModelOutput-like mapping."""


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x, *, mask):
        h = self.bn(self.lin(x))
        h = h.view(2, 2, 4)[:, 0]  # a view
        h.mul_(mask.float()[:, None])  # in place, with a bool tensor
        return _Output(logits=h, ids=torch.arange(2), parts=(h.sum(), h.mean()))


def test_handles_mapping_outputs_kwargs_views_inplace_and_restores_buffers() -> None:
    net = _Net().train()
    x = torch.randn(4, 4)
    mask = torch.tensor([True, False])
    state = {k: v.clone() for k, v in net.state_dict().items()}

    def fn(x, *, mask):
        out = net(x, mask=mask)
        out["parts"][0].backward()
        return out

    assert ng.locate(fn, x, mask=mask, model=net) is None
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
    x[0, 0] = float("nan")
    diag = ng.locate(fn, x, mask=mask, model=net)
    assert diag.cause == "data.nonfinite" and diag.evidence["origin"]["path"] == "x"
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items()), "BatchNorm stats changed"


def test_in_place_writes_to_parameters_are_undone() -> None:
    model = nn.Linear(3, 3)
    before = model.weight.detach().clone()

    def fn():
        with torch.no_grad():
            model.weight.add_(1.0)
        return model(torch.ones(1, 3)).sum()

    assert ng.locate(fn, model=model) is None
    assert torch.equal(model.weight, before)


def test_hooks_and_modes_are_removed_even_when_fn_raises() -> None:
    hooks = (len(module_mod._global_forward_pre_hooks), len(module_mod._global_forward_hooks))
    model = nn.Linear(2, 2)

    def boom():
        model(torch.ones(1, 2))
        raise KeyError("user bug")

    with pytest.raises(KeyError, match="user bug"):
        ng.locate(boom, model=model)
    assert (len(module_mod._global_forward_pre_hooks), len(module_mod._global_forward_hooks)) == hooks
    assert _get_current_dispatch_mode() is None


def test_index_error_outside_embedding_is_not_swallowed() -> None:
    with pytest.raises(IndexError):
        ng.locate(lambda: [1][3])


def test_gradients_without_a_model_are_checked_through_leaf_tensors() -> None:
    w = torch.zeros(3, requires_grad=True)

    def fn():
        (w.norm() * 0 + (w * w).sum().sqrt()).backward()
        return torch.tensor(1.0)

    diag = ng.locate(fn)
    assert diag is not None and diag.phase == "backward" and diag.cause == "op.sqrt_domain"


def test_nonfinite_parameter_names_its_owner() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    with torch.no_grad():
        model[2].weight[0, 1] = float("nan")
    diag = ng.locate(lambda: model(torch.ones(1, 2)).sum(), model=model)
    assert diag.cause == "parameters.nonfinite" and diag.phase == "parameters" and diag.module == "2"
    assert diag.evidence["origin"]["path"] == "2.weight"


def test_integer_and_bool_only_results_are_finite() -> None:
    assert ng.locate(lambda x: (x > 0, x.long()), torch.randn(3)) is None


def test_a_shape_bug_in_an_index_op_is_raised_not_called_bad_data() -> None:
    x = torch.randn(4, 5, requires_grad=True)
    idx = torch.zeros(3, 2, 2, dtype=torch.long)  # wrong rank for gather: a code bug, ids are in range
    with pytest.raises(RuntimeError):
        ng.locate(lambda: torch.gather(x, 1, idx).sum())


def test_writes_through_views_and_data_are_undone() -> None:
    model = nn.Linear(3, 3)
    before = model.weight.detach().clone()

    def fn():
        with torch.no_grad():
            model.weight[0].fill_(5.0)  # a view: its own tensor, the weight's storage
            model.weight.data.mul_(2.0)
        return model(torch.ones(1, 3)).sum()

    assert ng.locate(fn, model=model) is None
    assert torch.equal(model.weight, before)


def test_overflow_of_a_power_records_its_input_max() -> None:
    x = torch.tensor([1.0, 3e20, -2.0])
    diag = ng.locate(lambda x: (x**2).sum(), x)
    assert diag.op == "aten.pow.Tensor_Scalar" and diag.kind == "inf"
    assert diag.evidence["origin"]["input_max"] == pytest.approx(3e20)


@pytest.mark.parametrize(
    ("name", "kind", "created_in"),
    [
        ("token_id_out_of_range", "invalid", {"op": "aten.embedding.default", "phase": "forward"}),
        ("label_out_of_range", "invalid", {"op": "aten.nll_loss_forward.default", "phase": "forward"}),
        ("all_labels_ignored", "nan", {"op": "aten.nll_loss_forward.default", "phase": "forward"}),
    ],
)
def test_data_causes_keep_phase_data_and_name_the_op_that_met_the_input(name, kind, created_in) -> None:
    scenario = next(s for s in SCENARIOS if s.name == name)
    diag = _locate_fault_only(scenario)
    assert (diag.cause, diag.phase, diag.kind) == (scenario.expect.cause, "data", kind)
    assert diag.evidence["created_in"] == created_in
    assert ng.Diagnosis.from_dict(diag.to_dict()).kind == kind  # "invalid" survives the JSON round trip


def _locate_fault_only(scenario):
    """The faulty batch on the freshly built model: a data fault does not need the steps before it."""
    run = build(scenario)
    return ng.locate(train_step, run.model, run.batch(scenario.fault_step), model=run.model)


def test_an_index_error_outside_any_module_is_invalid_and_created_in_the_forward() -> None:
    emb = nn.Embedding(4, 2)
    ids = torch.tensor([0, 1])

    def fn():
        out = emb(ids).sum(0)
        return torch.index_select(out, 0, torch.tensor([5])).sum()

    diag = ng.locate(fn, model=emb)
    assert diag.cause == "data.index_out_of_range" and diag.kind == "invalid"
    assert diag.phase == "data" and diag.evidence["created_in"]["phase"] == "forward"


def test_data_nonfinite_inputs_have_no_op_that_created_them() -> None:
    diag = _locate_fault_only(next(s for s in SCENARIOS if s.name == "nan_pixels"))
    assert (diag.cause, diag.phase, diag.kind) == ("data.nonfinite", "data", "nan")
    assert "created_in" not in diag.evidence  # the NaN came in with the batch


def test_profiler_regions_leave_no_ops_in_the_path() -> None:
    """torch.profiler.record_function (HF models use it) dispatches ops of its own: bookkeeping, not the path."""
    x = torch.rand(4, 4, requires_grad=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        with torch.profiler.record_function("block"):
            y = torch.log(x - x)  # log(0): -inf
        with torch.profiler.record_function("head"):
            loss = (y * 2).sum()
        loss.backward()
        return loss

    diag = ng.locate(step, x)
    assert diag is not None and diag.op == "aten.log.default"
    path = [o["op"] for o in diag.evidence["before"] + diag.evidence["after"] if o.get("op")]
    assert path and not [op for op in path if op.startswith("profiler.")], path


def _masked_mean(model: torch.nn.Module, count_of) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        per_token = model(batch["x"]).squeeze(-1)
        mask = (batch["labels"] != -100).float()
        loss = (per_token * mask).sum() / count_of(mask, per_token)
        loss.backward()
        return loss

    return step


@pytest.mark.parametrize(
    ("count_of", "cause", "counted_from"),
    [
        (lambda mask, _: mask.sum(), "data.no_valid_targets", "batch['labels']"),  # the batch selected nothing
        (lambda mask, _: torch.zeros(()), "op.division_by_zero", None),  # a zero the code made, not the batch
        (lambda mask, out: (mask * out).sum() * 0, "op.division_by_zero", None),  # it went through the model
    ],
)
def test_a_zero_count_is_the_batchs_only_when_counted_from_the_batch(count_of, cause, counted_from) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    batch = {"x": torch.randn(4, 3), "labels": torch.full((4,), -100)}
    diag = ng.locate(_masked_mean(model, count_of), batch, model=model)
    assert diag is not None and diag.cause == cause and diag.op == "aten.div.Tensor"
    assert diag.evidence["origin"]["inputs"][1].get("counted_from") == counted_from
    assert diag.phase == ("data" if counted_from else "forward")


def test_code_that_raises_on_the_nan_it_made_still_gets_the_nan_named() -> None:
    # A loop that checks its own loss and raises: the NaN was created first, so locate names it
    # (the error path once returned a bare Diagnosis where the caller unpacks one with its comm count).
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = torch.log(x - 5)
        if not torch.isfinite(y).all():
            raise RuntimeError("loss is NaN, stopping")
        return y.sum()

    diag = ng.locate(fn, torch.ones(3))
    assert diag is not None and (diag.cause, diag.op) == ("op.log_domain", "aten.log.default")

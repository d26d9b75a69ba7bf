"""locate, third round (issue 25): a normalization told by what it computes, torch's own NaN results,
divisions inside composite ops, gradient surgery after backward(), NaNs that surface as a raise,
and ``diag.also`` naming the other class where two fit."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard as ng


def _where(diag):
    return diag.cause, diag.op, diag.module, diag.phase, diag.kind


def _also(diag):
    return [a["cause"] for a in diag.also]


def _step(model, loss_of):
    def fn(*args):
        model.zero_grad()
        loss = loss_of(*args)
        loss.backward()
        return loss

    return fn


# -- 1. a normalization by what it computes, not by its class name --------------------------
class _RMS(nn.Module):
    def __init__(self, eps: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Net(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4, bias=False)
        self.norm = norm

    def forward(self, x):
        return self.norm(self.fc(x))


_ZERO_ROW = torch.tensor([[1.0, 2.0, -1.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize("name", ["RMSNormNoEps", "FusedRMSNormAffine", "LayerNormFp32", "ScaleNorm"])
def test_an_rmsnorm_is_a_normalization_whatever_its_class_is_called(name) -> None:
    torch.manual_seed(0)
    model = _Net(type(name, (_RMS,), {})())
    diag = ng.locate(_step(model, lambda x: model(x).sum()), _ZERO_ROW, model=model)
    assert _where(diag) == ("norm.zero_variance", "aten.rsqrt.default", "norm", "forward", "inf")
    origin = diag.evidence["origin"]
    assert origin["statistic"] == "mean of squares" and origin["normalizes"] is True
    # rsqrt(0) is also a division by zero, with its own reason; never a "negative value"
    assert _also(diag) == ["op.division_by_zero"] and "exact zeros" in diag.also[0]["why"]
    assert "negative" not in diag.evidence["why"]


def test_a_healthy_rmsnorm_with_eps_on_a_zero_row_raises_no_alarm() -> None:
    model = _Net(_RMS(eps=1e-6))
    assert ng.locate(_step(model, lambda x: model(x).sum()), _ZERO_ROW, model=model) is None


class CrossNorm(nn.Module):
    """Named like a norm, but scales x by the RMS of another tensor: no normalization of x."""

    def forward(self, x, context):
        return x * torch.rsqrt(context.pow(2).mean(-1, keepdim=True))


class _CrossNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4, bias=False)
        self.ctx = nn.Linear(3, 4, bias=False)
        self.scale = CrossNorm()

    def forward(self, x, c):
        return self.scale(self.fc(x), self.ctx(c))


def test_a_class_named_norm_that_does_not_normalize_what_it_divides_is_a_division_by_zero() -> None:
    torch.manual_seed(0)
    model = _CrossNet()
    x, c = torch.ones(2, 3), _ZERO_ROW
    diag = ng.locate(_step(model, lambda x, c: model(x, c).sum()), x, c, model=model)
    assert _where(diag) == ("op.division_by_zero", "aten.rsqrt.default", "scale", "forward", "inf")
    assert diag.evidence["origin"]["normalizes"] is False


def test_rsqrt_of_an_exact_zero_outside_a_normalization_is_a_division_by_zero() -> None:
    w = torch.tensor([1.0, 0.0, 4.0], requires_grad=True)

    def fn(w):
        loss = (torch.rsqrt(w.detach()) * w).sum()  # an inverse-sqrt weighting of a zero count
        loss.backward()
        return loss

    diag = ng.locate(fn, w)
    assert (diag.cause, diag.op, diag.kind) == ("op.division_by_zero", "aten.rsqrt.default", "inf")
    assert "1 exact zeros" in diag.evidence["why"]


# -- 2. NaN torch returns by definition belongs to the user-level op -----------------------
class _InvConv(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(w)

    def forward(self, z):
        return z @ self.weight, self.weight.logdet()  # the method form


def test_logdet_of_a_negative_determinant_is_the_log_domain_of_logdet_not_a_nan_write() -> None:
    model = _InvConv(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    diag = ng.locate(_step(model, lambda z: model(z)[0].pow(2).sum() - model(z)[1]), torch.randn(3, 2), model=model)
    assert _where(diag) == ("op.log_domain", "aten.logdet.default", "", "forward", "nan")
    origin = diag.evidence["origin"]
    assert origin["category"] == "op" and origin["internal_op"] == "aten.where.self"
    assert origin["negative_determinants"] == 1 and origin["user_op"] == "logdet"
    assert "negative determinant" in diag.evidence["why"] and "slogdet" in diag.fixes[0]
    assert "inside" in str(diag) and "logdet" in str(diag)


def test_a_healthy_logdet_raises_no_alarm() -> None:
    model = _InvConv(torch.tensor([[2.0, 0.0], [0.0, 1.0]]))
    assert ng.locate(_step(model, lambda z: model(z)[0].sum() - model(z)[1]), torch.randn(3, 2), model=model) is None


class _Marker(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.how = how

    def forward(self, x, pad):
        h = self.proj(x)
        if self.how == "where":
            return torch.where(pad[:, None], float("nan"), h)
        return h.masked_fill(pad[:, None], float("nan"))


@pytest.mark.parametrize("how", ["where", "masked_fill"])
def test_a_nan_the_user_writes_is_still_a_nan_write(how) -> None:
    torch.manual_seed(0)
    model = _Marker(how)
    pad = torch.tensor([False, True])
    diag = ng.locate(_step(model, lambda x, pad: model(x, pad).sum()), torch.randn(2, 3), pad, model=model)
    assert diag.cause == "op.nan_write" and diag.evidence["origin"]["category"] == "write"


# -- 3. divisions inside composite ops ------------------------------------------------------
def test_weight_norm_of_a_zero_weight_names_the_norm_as_the_denominator() -> None:
    conv = nn.Conv1d(2, 3, 1)
    model = nn.utils.parametrizations.weight_norm(conv)
    with torch.no_grad():
        model.parametrizations.weight.original1.zero_()  # weight_v
    diag = ng.locate(_step(model, lambda x: model(x).sum()), torch.randn(1, 2, 4), model=model)
    assert (diag.cause, diag.op, diag.kind) == ("op.division_by_zero", "aten._weight_norm_interface.default", "nan")
    assert diag.evidence["origin"]["denominator"]["zeros"] == 3
    assert "norm.zero_variance" in _also(diag)
    assert "denominator" in ng.text.diagnosis_text(diag)


def _logits():
    return torch.linspace(-1.0, 1.0, 12).reshape(4, 3).requires_grad_()


def _weighted(weight, target):
    def fn(logits):
        loss = F.cross_entropy(logits, target, weight=weight)
        loss.backward()
        return loss

    return fn


def test_a_batch_of_only_zero_weighted_classes_is_no_valid_targets() -> None:
    weight = torch.tensor([0.0, 1.0, 3.0])
    diag = ng.locate(_weighted(weight, torch.tensor([0, 0, -100, 0])), _logits())
    assert (diag.cause, diag.op, diag.phase) == ("data.no_valid_targets", "aten.nll_loss_forward.default", "data")
    origin = diag.evidence["origin"]
    assert origin["denominator"]["value"] == 0.0 and origin["target_classes"] == [0]
    assert diag.evidence["created_in"] == {"op": "aten.nll_loss_forward.default", "phase": "forward"}
    assert _also(diag) == ["op.division_by_zero"]


def test_class_weights_that_are_all_zero_are_a_division_by_zero() -> None:
    diag = ng.locate(_weighted(torch.zeros(3), torch.tensor([0, 1, 2, 1])), _logits())
    assert (diag.cause, diag.phase) == ("op.division_by_zero", "forward")
    assert "every class weight is 0" in diag.evidence["why"]


def test_a_weighted_loss_with_one_weighted_target_raises_no_alarm() -> None:
    assert ng.locate(_weighted(torch.tensor([0.0, 1.0, 3.0]), torch.tensor([0, 0, 2, 0])), _logits()) is None


def test_f_normalize_without_eps_is_a_division_by_a_zero_norm_inside_a_normalization() -> None:
    x = _ZERO_ROW.clone().requires_grad_()

    def fn(x):
        loss = F.normalize(x, dim=-1, eps=0.0).sum()
        loss.backward()
        return loss

    diag = ng.locate(fn, x)
    assert (diag.cause, diag.op, diag.kind) == ("op.division_by_zero", "aten.div.Tensor", "nan")
    origin = diag.evidence["origin"]
    assert origin["statistic"] == "L2 norm" and origin["normalizes"] is True and origin["user_op"] == "normalize"
    assert _also(diag) == ["norm.zero_variance"] and "own L2 norm" in diag.also[0]["why"]


@pytest.mark.filterwarnings("ignore::UserWarning")  # the fault itself warns: var() of one element
@pytest.mark.parametrize(
    ("name", "statistic"), [("spectral_norm_zero_weight", "spectral norm"), ("adain_one_element", "std")]
)
def test_composite_normalizations_name_the_normalization_as_the_other_cause(name, statistic) -> None:
    from nanguard.zoo.wild import get_wild

    case = get_wild(name).build()
    diag = ng.locate(case.fn, *case.args, model=case.model)
    assert diag.cause == "op.division_by_zero"
    assert diag.evidence["origin"]["normalizes"] is True
    assert "norm.zero_variance" in _also(diag)
    if statistic == "std":  # the var over one element normalizes only through what it goes on to divide
        assert diag.evidence["origin"]["statistic"] == "variance"


def test_group_norm_over_one_element_per_group_says_so() -> None:
    model = nn.GroupNorm(4, 4, eps=0.0)
    x = torch.randn(2, 4, 1, 1)  # one element per group: a variance of 0 by construction
    diag = ng.locate(_step(model, lambda x: model(x).sum()), x, model=model)
    assert diag.cause == "norm.zero_variance" and diag.evidence["origin"]["group_elements"] == 1
    assert "1 element" in diag.evidence["why"]


# -- 4. gradient surgery: after backward(), before optimizer.step() -------------------------
class _Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.unused = nn.Linear(3, 1)

    def forward(self, x):
        return self.fc(x).sum()


def test_a_division_on_grad_after_backward_has_phase_backward_and_names_the_gradient() -> None:
    model = _Lin()

    def fn(x):
        model.zero_grad()
        loss = model(x)
        loss.backward()
        model.unused.weight.grad = torch.zeros_like(model.unused.weight)
        for p in (model.fc.weight, model.unused.weight):
            p.grad = p.grad / p.grad.abs().sum()  # a hand-written normalized gradient
        return loss

    diag = ng.locate(fn, torch.randn(2, 3), model=model)
    assert _where(diag) == ("op.division_by_zero", "aten.div.Tensor", None, "backward", "nan")
    assert diag.evidence["origin"]["gradient_surgery"] is True
    assert "gradients" in str(diag)


def test_a_hand_written_update_after_backward_has_phase_optimizer() -> None:
    model = _Lin()

    def fn(x):
        model.zero_grad()
        model(x).backward()
        with torch.no_grad():
            second_moment = torch.zeros_like(model.fc.weight)
            model.fc.weight.addcdiv_(model.fc.weight.grad * 0, second_moment)  # Adam with eps=0 on a zero moment
        return model(x)  # the loss after the update

    diag = ng.locate(fn, torch.randn(2, 3), model=model)
    assert (diag.cause, diag.op, diag.phase) == ("op.division_by_zero", "aten.addcdiv_.default", "optimizer")


def test_the_next_micro_batch_after_a_backward_stays_in_phase_forward() -> None:
    model = _Lin()

    def fn(a, b):
        model.zero_grad()
        model(a).backward()  # micro-batch 1
        b = (b - b.mean()) / b.std()  # micro-batch 2 normalized in the closure: constant, std 0
        loss = model(b)
        loss.backward()
        return loss

    diag = ng.locate(fn, torch.randn(2, 3), torch.ones(2, 3), model=model)
    assert diag.phase == "forward" and diag.op == "aten.div.Tensor"
    assert "gradient_surgery" not in diag.evidence["origin"]


# -- 5. a NaN that surfaces as an exception ------------------------------------------------
class _Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, obs, temperature):
        return self.fc(obs) / temperature


def _act(model):
    def fn(obs, temperature):
        model.zero_grad()
        dist = torch.distributions.Categorical(logits=model(obs, temperature), validate_args=True)
        loss = -dist.log_prob(dist.sample()).mean()
        loss.backward()
        return loss

    return fn


def test_a_nan_that_surfaces_as_validate_args_returns_the_origin_with_the_raise() -> None:
    torch.manual_seed(0)
    model = _Policy()
    with torch.no_grad():
        model.fc.bias.zero_()
    obs = torch.zeros(2, 4)  # logits 0 / temperature 0 = NaN
    diag = ng.locate(_act(model), obs, torch.tensor(0.0), model=model)
    assert _where(diag) == ("op.division_by_zero", "aten.div.Tensor", "", "forward", "nan")
    raised = diag.evidence["exception"]
    assert raised["type"] == "ValueError" and raised["message"].startswith("Expected parameter logits")
    assert raised["raised_at"].startswith(__file__)
    assert "raised" in str(diag) and "ValueError" in str(diag)


def test_a_user_assert_on_isfinite_returns_the_origin() -> None:
    x = torch.tensor([1.0, 0.0], requires_grad=True)

    def fn(x):
        loss = torch.log(x).sum()
        assert torch.isfinite(loss).all(), "loss is not finite"
        loss.backward()
        return loss

    diag = ng.locate(fn, x)
    assert (diag.cause, diag.op) == ("op.log_domain", "aten.log.default")
    assert diag.evidence["exception"] == {
        "type": "AssertionError",
        "message": "loss is not finite",
        "raised_at": diag.evidence["exception"]["raised_at"],
        "ops_after_read": diag.evidence["exception"]["ops_after_read"],
    }


def test_a_raise_with_nothing_non_finite_is_re_raised_unchanged() -> None:
    def fn(loc):
        # scale 0: finite, but invalid (validate_args explicit: a torch.compile earlier in the process turns it off)
        return torch.distributions.Normal(loc, torch.zeros(2), validate_args=True).sample()

    with pytest.raises(ValueError, match="Expected parameter scale") as err:
        ng.locate(fn, torch.zeros(2))
    assert not getattr(err.value, "__notes__", None)


def test_a_raise_long_after_a_dead_end_nan_is_re_raised() -> None:
    def fn(x):
        _ = torch.log(x - x)  # a -inf nobody uses
        y = x
        for _ in range(40):
            y = y * 1.0
        raise KeyError("unrelated")

    with pytest.raises(KeyError, match="unrelated"):
        ng.locate(fn, torch.ones(3))


def test_under_the_guard_the_closure_error_propagates_with_one_line_naming_the_origin() -> None:
    torch.manual_seed(0)
    model = _Policy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ng.Guard(model, opt, policy="skip")
    obs = torch.zeros(2, 4)
    with torch.no_grad():
        model.fc.bias.zero_()
        before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="Expected parameter logits") as err:
        guard.step(lambda: _act(model)(obs, torch.tensor(0.0)))
    (note,) = err.value.__notes__
    assert "aten.div.Tensor" in note and "op.division_by_zero" in note and __file__ in note
    assert guard.step_count == 0 and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="Expected parameter probs") as err:  # nothing non-finite: no note
        probs = torch.tensor([-1.0, 2.0])
        guard.step(lambda: torch.distributions.Categorical(probs=probs, validate_args=True).sample())
    assert not getattr(err.value, "__notes__", None)

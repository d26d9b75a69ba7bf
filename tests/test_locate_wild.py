"""locate on model and loss code written the way users write it (issue 11's tracer-side classes):
torch.compile, custom autograd Functions, reentrant checkpointing, -inf mask fills that reach
the loss, -inf in the batch, NaN written in place, and "your code" behind a library frame."""

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import nanguard as ng


def _where(diag):
    return diag.cause, diag.op, diag.module, diag.phase, diag.kind


def _line(fn, offset):
    return f"{__file__}:{fn.__code__.co_firstlineno + offset}"


# -- torch.compile -------------------------------------------------------------------------
class _LogHead(nn.Module):
    def forward(self, h):
        return torch.log(torch.relu(h))


class _LogNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.feat = nn.Linear(4, 4)
        self.head = _LogHead()
        with torch.no_grad():
            self.feat.weight.copy_(torch.eye(4))
            self.feat.bias.zero_()

    def forward(self, x):
        return self.head(self.feat(x))


def _closure(model):
    def fn(x):
        model.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    return fn


def test_compiled_model_is_replayed_eagerly_and_named_as_written() -> None:
    from torch._dynamo.utils import counters

    net = _LogNet()
    compiled = torch.compile(net, backend="eager")
    fn = _closure(compiled)
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5], [2.0, 1.0, 1.5, -4.0]])
    fn(x)  # the run compiled its step already
    frames = counters["stats"]["unique_graphs"]
    diag = ng.locate(fn, x, model=compiled)
    assert counters["stats"]["unique_graphs"] == frames, "the replay went through dynamo"
    assert _where(diag) == ("op.log_domain", "aten.log.default", "head", "forward", "inf")
    assert _where(ng.locate(_closure(net), x, model=net)) == _where(diag)
    assert "_orig_mod" not in str(diag.to_dict())


def test_guard_on_a_compiled_model_detects_diagnoses_and_skips() -> None:
    torch.manual_seed(0)
    net = _LogNet()
    compiled = torch.compile(net, backend="eager")
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    guard = ng.Guard(compiled, opt, policy="skip")
    fn = _closure(compiled)
    good, bad = torch.rand(2, 4) + 1.0, torch.tensor([[1.0, -2.0, 3.0, 0.5], [2.0, 1.0, 1.5, 4.0]])
    assert guard.step(lambda: fn(good), batch=good) is not None
    before = {k: v.clone() for k, v in net.state_dict().items()}
    assert guard.step(lambda: fn(bad), batch=bad) is None
    assert guard.skipped == 1
    assert _where(guard.last_diagnosis) == ("op.log_domain", "aten.log.default", "head", "forward", "inf")
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


# -- backward of custom Functions and reentrant checkpoints --------------------------------
class _ScaleInv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        size = x.norm(dim=-1, keepdim=True)
        ctx.save_for_backward(size)
        return x / size.clamp_min(1e-6)

    @staticmethod
    def backward(ctx, grad):
        (size,) = ctx.saved_tensors
        return grad / size


class _Scaler(nn.Module):
    def forward(self, x):
        return _ScaleInv.apply(x)


class _ScaleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 4, bias=False)
        self.scale = _Scaler()
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        return self.out(self.scale(self.embed(x)))


def test_custom_function_backward_is_attributed_to_the_module_that_applied_it() -> None:
    torch.manual_seed(0)
    model = _ScaleNet()
    diag = ng.locate(_closure(model), torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]), model=model)
    assert _where(diag) == ("op.division_by_zero", "aten.div.Tensor", "scale", "backward", "inf")
    assert diag.evidence["origin"]["node"] == "_ScaleInvBackward"
    assert diag.source == _line(_ScaleInv.forward, 2)  # the Function's forward, where its node was made


class _L2Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        h = self.proj(x)
        return h.pow(2).sum(-1).sqrt()


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _L2Block()

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=True)


def test_reentrant_checkpoint_backward_is_attributed_to_the_checkpointed_block() -> None:
    torch.manual_seed(0)
    model = _Checkpointed()
    x = torch.tensor([[1.0, 2.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    diag = ng.locate(_closure(model), x, model=model)
    assert _where(diag) == ("op.sqrt_domain", "aten.div.Tensor", "block", "backward", "inf")
    assert diag.evidence["origin"]["node"] == "SqrtBackward0"
    assert diag.source == _line(_L2Block.forward, 2)


# -- -inf mask fills that reach the loss, and -inf in the batch ----------------------------
class _MaskedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 6)
        self.register_buffer("banned", torch.tensor([False, False, False, False, True, True]))

    def forward(self, h):
        return self.proj(h).masked_fill(self.banned, float("-inf"))


class _Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = _MaskedHead()

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def test_mask_fill_reaching_a_label_smoothed_loss_is_not_data() -> None:
    torch.manual_seed(0)
    model = _Decoder()

    def fn(x, y):
        loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        loss.backward()
        return loss

    diag = ng.locate(fn, torch.randn(3, 8), torch.tensor([0, 1, 3]), model=model)
    assert _where(diag) == ("op.mask_fill_in_loss", "aten.masked_fill.Scalar", "head", "forward", "inf")
    assert diag.evidence["origin"]["outputs"][0]["neginf"] == 2 * 3
    # Without smoothing only the targets' log-probabilities count: the same fill is harmless.
    assert ng.locate(lambda x, y: F.cross_entropy(model(x), y), torch.randn(3, 8), torch.tensor([0, 1, 3])) is None


class _MaskedPolicy(nn.Module):
    def __init__(self):
        super().__init__()
        self.logits = nn.Linear(4, 5)

    def forward(self, obs, valid):
        return self.logits(obs).masked_fill(~valid, float("-inf"))


def test_entropy_over_masked_logits_names_the_fill_not_the_product() -> None:
    torch.manual_seed(0)
    policy = nn.ModuleDict({"policy": _MaskedPolicy()})
    valid = torch.tensor([[True, True, False, True, False], [True, False, True, True, True]])

    def fn(obs, valid):
        logp = torch.log_softmax(policy["policy"](obs, valid), -1)
        entropy = -(logp.exp() * logp).sum(-1).mean()  # 0 * -inf = NaN
        loss = -logp[:, 0].mean() - 0.01 * entropy
        loss.backward()
        return loss

    diag = ng.locate(fn, torch.randn(2, 4), valid, model=policy)
    assert _where(diag) == ("op.mask_fill_in_loss", "aten.masked_fill.Scalar", "policy", "forward", "inf")
    assert any(step["op"] == "aten.mul.Tensor" and step["nan"] for step in diag.evidence["after"])


def test_fully_masked_softmax_row_is_still_the_softmax() -> None:
    def fn(scores, keep):
        return torch.softmax(scores.masked_fill(~keep, float("-inf")), -1).sum()

    keep = torch.tensor([[True, False], [False, False]])
    diag = ng.locate(fn, torch.randn(2, 2), keep)
    assert (diag.cause, diag.op) == ("op.masked_softmax", "aten._softmax.default")


class _Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(5, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(torch.relu(self.encoder(x))).squeeze(-1)


@pytest.mark.parametrize("zeros", [False, True], ids=["features", "zeros_and_neginf"])
def test_neg_inf_in_a_batch_feature_is_data(zeros) -> None:
    torch.manual_seed(0)
    model = _Regressor()
    feats = torch.zeros(4, 5) if zeros else torch.randn(4, 5)
    feats[2, 3] = float("-inf")  # log-energy of a silent frame; log(0) of a count
    target = torch.randn(4)

    def fn(feats, target):
        loss = F.mse_loss(model(feats), target)
        loss.backward()
        return loss

    diag = ng.locate(fn, feats, target, model=model)
    assert (diag.cause, diag.phase, diag.kind) == ("data.nonfinite", "data", "inf")
    assert diag.evidence["origin"]["path"] == "feats"


# -- NaN written in place ------------------------------------------------------------------
def _pad_nan(h, pad):
    h[pad] = float("nan")


def _fill_nan(h, pad):
    h[pad.any(-1)].fill_(float("nan"))  # a copy: harmless
    h[0, 2].fill_(float("nan"))


def _masked_nan(h, pad):
    h.masked_fill_(pad[..., None], float("nan"))


class _Encoder(nn.Module):
    def __init__(self, write):
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.write = write

    def forward(self, x, pad):
        h = self.proj(x)
        self.write(h, pad)
        return h


@pytest.mark.parametrize(
    ("write", "op"),
    [
        (_pad_nan, "aten.index_put_.default"),
        (_fill_nan, "aten.fill_.Scalar"),
        (_masked_nan, "aten.masked_fill_.Scalar"),
    ],
    ids=["index", "fill", "masked_fill"],
)
def test_nan_written_in_place_names_the_writing_op(write, op) -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"encoder": _Encoder(write)})
    pad = torch.tensor([[False, False, True], [False, False, False]])

    def fn(x, pad):
        loss = model["encoder"](x, pad).mean(1).sum()
        loss.backward()
        return loss

    diag = ng.locate(fn, torch.randn(2, 3, 3), pad, model=model)
    assert _where(diag) == ("op.nan_write", op, "encoder", "forward", "nan")
    assert diag.evidence["origin"]["written"] == "nan"


# -- "your code" behind a library frame ----------------------------------------------------
def test_source_is_the_users_line_and_the_library_line_is_kept(tmp_path) -> None:
    lib = tmp_path / "site-packages" / "fakelib_g1.py"
    lib.parent.mkdir()
    lib.write_text("import torch\n\n\ndef loss_fn(p):\n    return -torch.log(p).mean()\n")
    spec = importlib.util.spec_from_file_location("fakelib_g1", lib)
    fakelib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fakelib)
    sys.modules.pop("fakelib_g1", None)

    def fn(p):
        return fakelib.loss_fn(p)  # the user's line

    diag = ng.locate(fn, torch.tensor([0.5, 0.0]))
    assert diag.cause == "op.log_domain"
    assert diag.source == _line(fn, 1)
    assert diag.evidence["library_source"] == f"{lib}:5"

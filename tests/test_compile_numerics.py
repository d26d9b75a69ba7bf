"""The compiler as a cause (``compile.numerics``): a step whose eager replay is finite is replayed
compiled again; a planted miscompile is named with its graph, module and fixes, a model bug keeps
its ordinary diagnosis, and a healthy compiled run never trips."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanguard as ng
from nanguard import compat
from nanguard.zoo.miscompile import miscompiling

pytest.importorskip("torch._dynamo")


class Net(nn.Module):
    def __init__(self, log_of: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(2))
        self.head = nn.Linear(8, 1)
        self.log_of = log_of

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.blocks[0](x)
        torch._dynamo.graph_break()  # two dynamo graphs: the miscompile hits the second only
        x = x + self.blocks[1](x)
        out = self.head(x)
        return torch.log(out - out.detach().max() - 1 + 1) if self.log_of else out


def _train(model: nn.Module, compiled: nn.Module, steps: int, state: dict[str, int], **options) -> ng.Guard:
    opt = torch.optim.SGD(compiled.parameters(), lr=0.05)
    guard = ng.Guard(compiled, opt, module_stats=False, **options)
    for i in range(steps):
        state["now"] = i
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))

        def closure(x=x):
            opt.zero_grad()
            loss = compiled(x).pow(2).mean()
            loss.backward()
            return loss

        guard.step(closure)
    return guard


def test_a_planted_miscompile_is_the_compiler_with_its_graph_and_module() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, state = Net(), {"at": 3, "now": 0}
    guard = _train(
        model, torch.compile(model, backend=miscompiling("blocks.1", lambda: state["now"] == state["at"])), 5, state
    )
    diag = guard.last_diagnosis
    assert guard.skipped == 1 and diag.step == 3
    assert diag.cause == "compile.numerics" and diag.phase == "forward"
    ev = diag.evidence
    assert ev["eager_replay"] == "finite" and ev["compiled_replay"] == "non-finite"
    assert (ev["graph"], ev["graphs"]) == (1, 2)  # the second graph, not the first
    assert "blocks.1.0" in ev["graph_modules"] and not any(m.startswith("blocks.0") for m in ev["graph_modules"])
    assert diag.module == "head"  # the node that produced the graph's corrupted output
    assert ev["aot_eager_finite"] is True  # the same graph without the backend's code is finite
    assert ev["backend"] == "backend"  # the planted backend's own name
    assert any("torch._dynamo.disable(model.head.forward)" in f for f in diag.fixes)
    assert any("aot_eager" in f for f in diag.fixes) and any("TORCHDYNAMO_REPRO_AFTER" in f for f in diag.fixes)


def test_a_model_nan_in_eager_and_compiled_keeps_its_ordinary_diagnosis() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, state = Net(log_of=True), {"at": -1, "now": 0}
    guard = _train(model, torch.compile(model, backend="eager"), 1, state)
    diag = guard.last_diagnosis
    assert diag.cause == "op.log_domain" and diag.op == "aten.log.default"


def test_a_healthy_compiled_run_never_trips() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, state = Net(), {"at": -1, "now": 0}
    guard = _train(
        model, torch.compile(model, backend=miscompiling("blocks.1", lambda: state["now"] == state["at"])), 12, state
    )
    assert guard.skipped == 0 and guard.last_diagnosis is None


def test_a_transient_in_a_compiled_run_is_still_not_reproduced() -> None:
    # The compiled replay is finite too: not the compiler.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, state = Net(), {"at": -1, "now": 0}
    guard = _train(model, torch.compile(model, backend="eager"), 6, state, inject="corrupt_allreduce@step=4")
    assert guard.last_diagnosis.cause == "step.not_reproduced"


def test_compat_finds_the_backend_a_module_was_compiled_with() -> None:
    backend = miscompiling("blocks.1", lambda: False)
    compiled = torch.compile(Net(), backend=backend)
    found = compat.compiled_backend(compiled)
    assert found is not None and getattr(found, "compiler_fn", found) is backend
    assert getattr(compat.compiled_backend(torch.compile(Net())), "compiler_name", None) == "inductor"
    assert compat.compiled_backend(Net()) is None
    assert callable(compat.lookup_backend("aot_eager"))


@pytest.mark.slow
def test_a_miscompile_on_top_of_inductor_is_named_with_inductor_codegen() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, state = Net(), {"at": 2, "now": 0}
    inductor = compat.lookup_backend("inductor")
    guard = _train(
        model,
        torch.compile(model, backend=miscompiling("blocks.1", lambda: state["now"] == state["at"], inner=inductor)),
        3,
        state,
    )
    diag = guard.last_diagnosis
    assert diag.cause == "compile.numerics" and diag.evidence["graph"] == 1 and diag.evidence["aot_eager_finite"]


def test_compile_numerics_is_a_cause_with_a_docs_row() -> None:
    from pathlib import Path

    causes = (Path(__file__).resolve().parent.parent / "docs" / "causes.md").read_text(encoding="utf-8")
    assert "compiler" in ng.CAUSES["compile.numerics"]
    for cause in ng.CAUSES:
        assert f"| `{cause}` |" in causes, cause

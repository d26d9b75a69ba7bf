import os

import pytest
import torch

# Reductions split their work by thread count, so a float result near a boundary could
# depend on the machine's core count: every test runs with the same two threads.
torch.set_num_threads(2)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``slow`` tests (the long chaos soak, inductor on CPU) run with ``-m slow`` or NANGUARD_SLOW=1;
    their short variants always run, so ``make test`` stays within its time budget."""
    if os.environ.get("NANGUARD_SLOW") == "1" or "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow or NANGUARD_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts ``Tensor.tolist`` calls (the audits' host reads): the numel of each, in order."""
    reads: list[int] = []
    tolist = torch.Tensor.tolist

    def counting_tolist(self: torch.Tensor):
        reads.append(self.numel())
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    return reads

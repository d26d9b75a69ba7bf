import pytest
import torch

# Reductions split their work by thread count, so a float result near a boundary could
# depend on the machine's core count: every test runs with the same two threads.
torch.set_num_threads(2)


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

"""Names from a model reach the HTML page as text: the root module's ``<root>`` is escaped, not a tag."""

from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("matplotlib")

import nanguard as ng
from nanguard.events import EventLog
from nanguard.report import load_run, render_html


class LogAtRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.fc(x).relu()).sum()  # log(0) at the root module


def test_the_root_module_is_shown_escaped(tmp_path: Path) -> None:
    model = LogAtRoot()
    with torch.no_grad():
        model.fc.bias.fill_(-100.0)  # every output of fc is negative, so relu gives zeros

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x)
        loss.backward()
        return loss

    diag = ng.locate(step, torch.rand(2, 4), model=model)
    assert diag is not None and diag.module == ""  # the origin is in the root module
    log = EventLog(tmp_path, rank=0)
    log.write("start", 0, config={}, world_size=1, path="host")
    log.write("step", 0, loss=1.0, grad_norm=1.0, skipped=False, scale=None)
    log.write("trip", 1, action="skip", ranks=[0], diagnosis=diag.to_dict())
    log.write("skip", 1, reason=diag.cause)
    log.write("end", 2, skipped=1, rollbacks=0)
    log.close()

    html = render_html(load_run(tmp_path))
    assert "&lt;root&gt;" in html
    assert "<root>" not in html  # a raw <root> would be an invisible unknown tag

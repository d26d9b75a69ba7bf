"""The tracer reads a normalization module's eps wherever the module keeps it."""

import torch
from torch import nn

from nanguard.tracer.modules import ModuleStack


class _HFNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.variance_epsilon = 1e-6


class _ClassEps(nn.Module):
    epsilon = 1e-3


class _PropertyEps(nn.Module):
    @property
    def eps(self) -> float:
        return 2e-5


class _BufferEps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("eps", torch.tensor(1e-5))


class _FlagEps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.eps = True


def test_eps_from_instance_class_and_property() -> None:
    # The modules stay alive: eps is cached per module id for one trace.
    modules = [nn.LayerNorm(4, eps=1e-4), _HFNorm(), _ClassEps(), _PropertyEps()]
    stack = ModuleStack()
    assert [stack.eps(m) for m in modules] == [1e-4, 1e-6, 1e-3, 2e-5]


def test_no_eps_from_a_tensor_a_flag_or_a_plain_module() -> None:
    modules = [_BufferEps(), _FlagEps(), nn.Linear(2, 2), None]
    stack = ModuleStack()
    assert [stack.eps(m) for m in modules] == [None] * 4

"""One walker over nested inputs: the paths users see, for every kind of container."""

from collections import OrderedDict, deque, namedtuple
from dataclasses import dataclass, field

import pytest
import torch

from nanguard import tree

Pair = namedtuple("Pair", ["inputs", "target"])


class _Output(OrderedDict):
    """A ModelOutput-like mapping."""


@dataclass
class _Batch:
    pixel_values: torch.Tensor
    labels: list = field(default_factory=list)


def _paths(obj, prefix="batch"):
    return [path for path, _ in tree.tensors_with_path(obj, prefix)]


def test_paths_for_dicts_lists_and_tuples() -> None:
    t = torch.zeros(1)
    batch = {"images": [t, (t, t)], "meta": {"scale": t, 3: t}}
    assert _paths(batch) == [
        "batch['images'][0]",
        "batch['images'][1][0]",
        "batch['images'][1][1]",
        "batch['meta']['scale']",
        "batch['meta'][3]",
    ]


def test_paths_for_records_namedtuples_and_mapping_subclasses() -> None:
    t = torch.zeros(1)
    assert _paths(_Output(logits=t, parts=(t,)), "result") == ["result['logits']", "result['parts'][0]"]
    assert _paths(_Batch(t, [t])) == ["batch.pixel_values", "batch.labels[0]"]
    assert _paths(Pair(t, t)) == ["batch.inputs", "batch.target"]
    assert _paths(deque([t])) == ["batch[0]"]  # a type registered with pytree, walked as registered


def test_hf_model_output_walks_as_a_mapping_of_its_set_fields() -> None:
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    t = torch.zeros(1)
    out = modeling_outputs.CausalLMOutput(loss=t, logits=t)  # hidden_states stays None
    assert _paths(out, "result") == ["result['loss']", "result['logits']"]


def test_non_tensor_leaves_are_kept_by_the_walk_and_skipped_by_tensors() -> None:
    t = torch.zeros(1)
    leaves = [(tree.path_str("x", kp), leaf) for kp, leaf in tree.leaves_with_path({"a": 1, "b": [t, "s"]})]
    assert [p for p, _ in leaves] == ["x['a']", "x['b'][0]", "x['b'][1]"]
    assert leaves[0][1] == 1 and leaves[1][1] is t
    assert tree.tensors({"a": 1, "b": [t, "s"]}) == [t]


def test_deep_nesting_keeps_the_full_path_and_stops_at_the_limit() -> None:
    t = torch.zeros(1)
    deep = t
    for _ in range(20):
        deep = [deep]
    assert _paths(deep) == ["batch" + "[0]" * 20]
    too_deep = t
    for _ in range(tree.MAX_DEPTH + 1):
        too_deep = [too_deep]
    assert _paths(too_deep) == []


def test_a_cycle_ends_the_walk() -> None:
    t = torch.zeros(1)
    loop: list = [t]
    loop.append(loop)
    assert _paths(loop) == ["batch[0]"]


def test_nearest_name_is_the_innermost_string_key_or_field() -> None:
    t = torch.zeros(1)
    names = [tree.nearest_name(kp) for kp, _ in tree.leaves_with_path({"labels": [t], 0: t, "x": Pair(t, t)})]
    assert names == ["labels", None, "inputs", "target"]


def test_map_leaves_rebuilds_the_structure() -> None:
    out = tree.map_leaves(lambda x: x * 2, {"a": [1, (2, 3)], "b": 4})
    assert out == {"a": [2, (4, 6)], "b": 8}


def test_op_leaves_flattens_nested_op_arguments() -> None:
    t = torch.zeros(1)
    assert tree.op_leaves((t, [1, [2.0, t]], {"k": None})) == [t, 1, 2.0, t, None]


def test_containers_and_leaves() -> None:
    assert tree.is_container({}) and tree.is_container(Pair(1, 2)) and tree.is_container(_Batch(torch.zeros(1)))
    assert not tree.is_container(torch.zeros(2)) and not tree.is_container("text") and not tree.is_container(_Batch)

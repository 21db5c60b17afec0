"""The flat-buffer codec (``aiocollect._transport._flat``): layouts, alignment, round trips."""

from __future__ import annotations

import pickle

import pytest
import torch
from tensordict import TensorDict

from aiocollect._transport._flat import ALIGN, FlatBuffer, FlatLayout, layout_of, rebuild
from aiocollect._transport._shm import SharedBlock


def _odd_batch() -> TensorDict:
    td = TensorDict(
        {
            "obs": torch.randn(4, 3, 5),
            "bool": torch.tensor([True, False, True, True]),
            "int8": torch.arange(4, dtype=torch.int8).reshape(4, 1),
            "half": torch.randn(4, 7).half(),
            "bf16": torch.randn(4, 2).bfloat16(),
            "f64": torch.randn(4, 1, 1).double(),
            "c64": torch.randn(4, 3, dtype=torch.complex64),
            "empty": torch.empty(4, 0),
            ("next", "obs"): torch.randn(4, 3, 5),
            ("next", "deep", "reward"): torch.randn(4, 1),
            ("collector", "traj_ids"): torch.arange(4, dtype=torch.int64),
        },
        batch_size=[4],
    )
    td.names = ["time"]
    return td


def test_round_trip_keeps_every_leaf_dtype_shape_and_value() -> None:
    td = _odd_batch()
    buffer = FlatBuffer(layout_of(td))
    buffer.pack(td)
    out = buffer.unpack()
    assert set(out.keys(include_nested=True, leaves_only=True)) == set(
        td.keys(include_nested=True, leaves_only=True)
    )
    for key, value in td.items(include_nested=True, leaves_only=True):
        assert out.get(key).dtype == value.dtype
        assert out.get(key).shape == value.shape
        assert torch.equal(out.get(key), value)
    assert out.batch_size == td.batch_size
    assert out.names == ["time"]


def test_unpack_owns_its_memory() -> None:
    td = TensorDict({"a": torch.ones(3)}, batch_size=[3])
    buffer = FlatBuffer(layout_of(td))
    buffer.pack(td)
    out = buffer.unpack()
    buffer.views["a"].zero_()
    assert torch.equal(out["a"], torch.ones(3))


def test_every_leaf_is_64_byte_aligned_and_inside_the_buffer() -> None:
    layout = layout_of(_odd_batch())
    assert layout.nbytes % ALIGN == 0
    end = 0
    for leaf in layout.leaves:
        assert leaf.offset % ALIGN == 0
        assert leaf.offset >= end  # no overlap, in order
        assert leaf.nbytes == leaf.dtype.itemsize * int(torch.Size(leaf.shape).numel())
        end = leaf.offset + leaf.nbytes
    assert end <= layout.nbytes
    buffer = FlatBuffer(layout)
    for leaf in layout.leaves:
        view = buffer.views.get(leaf.key)
        if leaf.nbytes:
            assert view.data_ptr() == buffer.data.data_ptr() + leaf.offset


def test_nested_keys_are_tuples() -> None:
    layout = layout_of(_odd_batch())
    assert layout.leaf(("next", "deep", "reward")).shape == (4, 1)
    assert layout.leaf("obs").key == ("obs",)
    with pytest.raises(KeyError, match="no leaf"):
        layout.leaf("missing")


def test_empty_tensordict_has_a_minimal_buffer() -> None:
    layout = layout_of(TensorDict({}, batch_size=[2]))
    assert layout.leaves == ()
    assert layout.nbytes == ALIGN
    out = FlatBuffer(layout).unpack()
    assert out.batch_size == torch.Size([2])
    assert len(list(out.keys())) == 0


def test_layout_is_picklable_and_comparable() -> None:
    layout = layout_of(_odd_batch())
    assert pickle.loads(pickle.dumps(layout)) == layout
    assert layout_of(_odd_batch()) == layout
    other = _odd_batch()
    other["obs"] = torch.randn(4, 3, 6)
    assert layout_of(other) != layout


def test_build_and_views_over_a_given_buffer() -> None:
    layout = FlatLayout.build([("a", (2,), torch.int64), (("b", "c"), (3,), torch.float32)])
    data = torch.zeros(layout.nbytes + 10, dtype=torch.uint8)
    buffer = FlatBuffer(layout, data=data)
    buffer.views["a"].fill_(7)
    assert buffer.data is data
    assert torch.equal(data[:16].view(torch.int64), torch.tensor([7, 7]))
    with pytest.raises(ValueError, match="at least"):
        FlatBuffer(layout, data=torch.zeros(8, dtype=torch.uint8))


def test_rebuild_from_leaves() -> None:
    td = rebuild({"a": torch.zeros(2, 3), ("b", "c"): torch.ones(2)}, (2,), ["t"])
    assert td.batch_size == torch.Size([2])
    assert td.names == ["t"]
    assert torch.equal(td["b", "c"], torch.ones(2))


def test_shared_block_maps_the_same_layout_by_name() -> None:
    td = _odd_batch()
    owner = SharedBlock(layout_of(td))
    try:
        owner.td.update_(td)
        mapped = SharedBlock(owner.layout, name=owner.name)
        try:
            assert (mapped.td == td).all()
            assert mapped.td.names == ["time"]
        finally:
            mapped.close()
    finally:
        owner.unlink()
        owner.close()

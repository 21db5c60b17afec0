"""``split_trajectories`` and ``Collector(split_trajs=True)``."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from aiocollect import Collector, GymEnv, split_trajectories

IDS = ("collector", "traj_ids")
MASK = ("collector", "mask")


def batch_of(ids: list, **extra: torch.Tensor) -> TensorDict:
    """A batch with the given trajectory ids, a frame counter ``"x"`` and whatever else is passed."""
    ids_t = torch.tensor(ids, dtype=torch.int64)
    n = ids_t.numel()
    td = TensorDict(
        {"x": torch.arange(1, n + 1).reshape(ids_t.shape), IDS: ids_t, **extra},
        batch_size=ids_t.shape,
    )
    return td


def reference(ids: torch.Tensor) -> list[list[int]]:
    """Flat frame indices of each trajectory: consecutive equal ids per row (time last), -1 dropped."""
    rows = ids.reshape(-1, ids.shape[-1]) if ids.dim() else ids.reshape(1, 1)
    T = rows.shape[-1]
    out: list[list[int]] = []
    for r, row in enumerate(rows.tolist()):
        prev = None
        for t, value in enumerate(row):
            if value != prev:
                out.append([])
                prev = value
            out[-1].append(r * T + t)
        # runs of -1 are dropped below
    flat = ids.reshape(-1).tolist()
    return [run for run in out if flat[run[0]] != -1]


def check_against_reference(td: TensorDict, out: TensorDict) -> None:
    runs = reference(td[IDS])
    max_len = max(len(r) for r in runs)
    assert out.batch_size == (len(runs), max_len)
    flat_x = td["x"].reshape(-1)
    flat_ids = td[IDS].reshape(-1)
    for i, run in enumerate(runs):
        n = len(run)
        assert out["x"][i, :n].tolist() == flat_x[run].tolist()
        assert (out["x"][i, n:] == 0).all()
        assert out[IDS][i, :n].tolist() == flat_ids[run].tolist()
        assert (out[IDS][i, n:] == -1).all()
        assert out[MASK][i].tolist() == [True] * n + [False] * (max_len - n)


class TestSplit:
    def test_one_dim(self):
        out = split_trajectories(batch_of([0, 0, 0, 1, 1]))
        assert out.batch_size == (2, 3)
        assert out["x"].tolist() == [[1, 2, 3], [4, 5, 0]]
        assert out[IDS].tolist() == [[0, 0, 0], [1, 1, -1]]
        assert out[MASK].tolist() == [[True, True, True], [True, True, False]]
        assert out[MASK].dtype == torch.bool
        assert out.names == [None, "time"]

    def test_one_trajectory(self):
        out = split_trajectories(batch_of([4, 4, 4]))
        assert out.batch_size == (1, 3)
        assert out[MASK].all()

    def test_every_frame_its_own_trajectory(self):
        out = split_trajectories(batch_of([0, 1, 2, 3]))
        assert out.batch_size == (4, 1)
        assert out["x"].flatten().tolist() == [1, 2, 3, 4]
        assert out[MASK].all()

    def test_batched_rows_then_time(self):
        out = split_trajectories(batch_of([[0, 0, 2, 2], [1, 1, 1, 3]]))
        assert out.batch_size == (4, 3)
        assert out[IDS].tolist() == [[0, 0, -1], [2, 2, -1], [1, 1, 1], [3, -1, -1]]
        assert out["x"].tolist() == [[1, 2, 0], [3, 4, 0], [5, 6, 7], [8, 0, 0]]

    def test_same_id_at_a_row_border_is_two_trajectories(self):
        # rows are different envs: the last frames of row 0 and the first of row 1 are not one episode
        out = split_trajectories(batch_of([[0, 0, 5], [5, 5, 1]]))
        assert out[IDS].tolist() == [[0, 0], [5, -1], [5, 5], [1, -1]]
        assert out["x"].tolist() == [[1, 2], [3, 0], [4, 5], [6, 0]]

    def test_three_dims(self):
        ids = [[[0, 0, 1], [2, 2, 2]], [[3, 4, 4], [5, 5, 6]]]
        td = batch_of(ids)
        out = split_trajectories(td)
        check_against_reference(td, out)
        assert out.batch_size == (7, 3)

    def test_invalid_frames_are_dropped(self):
        out = split_trajectories(batch_of([[0, 0, 2, -1], [1, 1, -1, -1]]))
        assert out[IDS].tolist() == [[0, 0], [2, -1], [1, 1]]
        assert out["x"].tolist() == [[1, 2], [3, 0], [5, 6]]
        assert out[MASK].sum() == 5

    def test_all_frames_invalid(self):
        with pytest.raises(ValueError, match="valid"):
            split_trajectories(batch_of([-1, -1]))

    def test_padding_is_zero_for_every_dtype(self):
        td = batch_of(
            [0, 0, 0, 1],
            obs=torch.full((4, 3), 7.5),
            flag=torch.ones(4, 1, dtype=torch.bool),
            count=torch.full((4,), 9, dtype=torch.int32),
            half=torch.ones(4, dtype=torch.bfloat16),
            nested=TensorDict({"deep": torch.full((4, 2), -3.0)}, batch_size=[4]),
        )
        out = split_trajectories(td)
        assert out.batch_size == (2, 3)
        assert out["obs"].shape == (2, 3, 3)
        assert out["obs"][1].tolist() == [[7.5] * 3, [0.0] * 3, [0.0] * 3]
        assert out["flag"].dtype == torch.bool
        assert out["flag"][1].flatten().tolist() == [True, False, False]
        assert out["count"].dtype == torch.int32
        assert out["count"][1].tolist() == [9, 0, 0]
        assert out["half"].dtype == torch.bfloat16
        assert out["half"][1].tolist() == [1.0, 0.0, 0.0]
        assert out["nested", "deep"][1].tolist() == [[-3.0, -3.0], [0.0, 0.0], [0.0, 0.0]]
        assert out[IDS].dtype == torch.int64

    def test_input_is_left_alone(self):
        td = batch_of([[0, 0, 1], [2, 3, 3]])
        td.names = [None, "time"]
        before = td.clone()
        split_trajectories(td)
        assert td.names == [None, "time"]
        assert MASK not in td.keys(include_nested=True)
        assert (td == before).all()

    def test_output_does_not_alias_the_input(self):
        td = batch_of([0, 0, 1])
        out = split_trajectories(td)
        out["x"].add_(100)
        assert td["x"].tolist() == [1, 2, 3]

    def test_custom_keys(self):
        td = TensorDict({"episode": torch.tensor([7, 7, 8]), "x": torch.tensor([1, 2, 3])}, batch_size=[3])
        out = split_trajectories(td, trajectory_key="episode", mask_key="valid")
        assert out["episode"].tolist() == [[7, 7], [8, -1]]
        assert out["valid"].tolist() == [[True, True], [True, False]]
        assert "collector" not in out.keys()  # noqa: SIM118

    def test_no_time_dim(self):
        td = TensorDict({IDS: torch.tensor(0)}, batch_size=[])
        with pytest.raises(ValueError, match="time dim"):
            split_trajectories(td)

    def test_missing_trajectory_ids(self):
        with pytest.raises(KeyError, match="traj_ids"):
            split_trajectories(TensorDict({"x": torch.zeros(3)}, batch_size=[3]))

    @settings(max_examples=60, deadline=None)
    @given(
        shape=st.sampled_from([(1,), (6,), (2, 5), (3, 1), (2, 2, 4)]),
        data=st.data(),
    )
    def test_matches_a_reference(self, shape, data):
        n = 1
        for d in shape:
            n *= d
        ids = data.draw(st.lists(st.integers(-1, 3), min_size=n, max_size=n))
        if all(i == -1 for i in ids):
            ids[0] = 0
        td = batch_of(ids)
        td = td.reshape(shape)
        out = split_trajectories(td)
        check_against_reference(td, out)
        assert out[MASK].sum() == sum(i != -1 for i in ids)


# -- through a collector -------------------------------------------------------------------------------
def collect(batches: int = 1, **kwargs: Any) -> list[TensorDict]:
    async def main() -> list[TensorDict]:
        out = []
        with anyio.fail_after(60):
            collector = Collector(
                lambda: GymEnv("CartPole-v1", num_envs=2), seed=0, total_frames=-1, **kwargs
            )
            try:
                async for batch in collector:
                    out.append(batch)
                    if len(out) == batches:
                        break
            finally:
                await collector.aclose()
        return out

    return anyio.run(main)


class TestCollectorSplit:
    def test_split_trajs(self):
        plain = collect(batches=2, frames_per_batch=64, max_frames_per_traj=12)
        split = collect(batches=2, frames_per_batch=64, max_frames_per_traj=12, split_trajs=True)
        for p, s in zip(plain, split, strict=True):
            assert p.batch_size == (2, 32)
            assert s.batch_dims == 2
            assert s.names == [None, "time"]
            assert s[MASK].dtype == torch.bool
            assert s[MASK].sum() == 64
            assert s.batch_size[1] <= 12  # no episode is longer than max_frames_per_traj
            # the same as splitting the plain batch afterwards
            assert (s == split_trajectories(p)).all()
            # one trajectory id per row, and the real frames are a prefix of the row
            for row, mask in zip(s[IDS], s[MASK], strict=True):
                assert len(set(row[mask].tolist())) == 1
                assert (row[~mask] == -1).all()
                n = int(mask.sum())
                assert mask[:n].all()
            # every trajectory that ends in the batch ends on its last real frame
            last = s[MASK].sum(-1) - 1
            done = s["next", "done"].squeeze(-1)
            assert done.sum() == p["next", "done"].sum()
            assert all(not done[i, : int(last[i])].any() for i in range(len(last)))
        # a trajectory going on in the next batch appears in both, with the same id
        ids0 = set(split[0][IDS][split[0][MASK]].tolist())
        ids1 = set(split[1][IDS][split[1][MASK]].tolist())
        assert ids0 & ids1

    def test_split_trajs_with_postproc(self):
        seen = []

        def postproc(batch):
            seen.append(batch.batch_size)
            return batch

        (batch,) = collect(frames_per_batch=32, split_trajs=True, postproc=postproc)
        assert seen == [batch.batch_size]
        assert MASK in batch.keys(include_nested=True)

    @pytest.mark.anyio
    async def test_split_trajs_on_every_backend(self):
        with anyio.fail_after(30):
            async with Collector(
                GymEnv("CartPole-v1"), frames_per_batch=32, total_frames=64, split_trajs=True
            ) as collector:
                sizes = [int(b[MASK].sum()) async for b in collector]
        assert sizes == [32, 32]

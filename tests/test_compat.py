"""aiocollect.compat without torchrl: keyword mapping, refusals, lazy start and shutdown, a script.

The same module against torchrl envs and policies is in tests/test_torchrl.py.
"""

from __future__ import annotations

import subprocess
import sys

import anyio
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from aiocollect import compat
from support import ListBuffer, cartpole

pytestmark = pytest.mark.anyio


def make_policy() -> TensorDictModule:
    torch.manual_seed(0)
    return TensorDictModule(
        nn.Sequential(nn.Linear(4, 2), ArgMax()), in_keys=["observation"], out_keys=["action"]
    )


INIT_CALLS: list[int] = []


def record_init() -> None:
    INIT_CALLS.append(1)


class ArgMax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(-1)


def test_importing_aiocollect_and_compat_does_not_import_torchrl() -> None:
    code = "import sys, aiocollect, aiocollect.compat; sys.exit('torchrl' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


async def test_torchrl_style_script() -> None:
    """torchrl's loop with the import changed and ``async`` added (torchrl's keyword spellings)."""
    from aiocollect.compat import SyncDataCollector, aenumerate

    policy = make_policy()
    collector = SyncDataCollector(
        cartpole,
        policy,
        frames_per_batch=64,
        total_frames=-1,
        max_frames_per_traj=-1,
        init_random_frames=0,
        split_trajs=None,
        reset_when_done=True,
        use_buffers=True,
        return_same_td=False,
        trust_policy=True,
        compile_policy=None,
        track_traj_ids=True,
        create_env_kwargs={"num_envs": 2},
    )
    frames = []
    with anyio.fail_after(30):
        async for i, data in aenumerate(collector):
            frames.append(data.numel())
            assert data.batch_size == (2, 32)
            await collector.update_policy_weights_()
            if i == 2:
                break
    await collector.shutdown()
    assert frames == [64, 64, 64]
    assert collector.policy_version == 3
    assert collector.stats()["frames"] == 192
    assert collector.inner.closed


async def test_iteration_end_shuts_the_collector_down() -> None:
    collector = compat.Collector([cartpole], frames_per_batch=16, total_frames=32)
    with anyio.fail_after(30):
        batches = [b async for b in collector]
    assert len(batches) == 2
    assert collector.inner.closed
    assert await collector.next() is None  # exhausted, as torchrl's next() says
    await collector.shutdown()  # idempotent


async def test_next_returns_none_at_the_end() -> None:
    collector = compat.SyncDataCollector(cartpole, frames_per_batch=16, total_frames=16)
    with anyio.fail_after(30):
        assert (await collector.next()).batch_size == (16,)
        assert await collector.next() is None


@pytest.mark.parametrize("name", ["MultiSyncDataCollector", "MultiaSyncDataCollector"])
async def test_multi_collectors_start_lazily_and_take_torchrl_keywords(name: str) -> None:
    INIT_CALLS.clear()
    started = []
    cls = getattr(compat, name)
    collector = cls(
        cartpole,
        num_workers=2,
        policy_factory=make_policy,
        frames_per_batch=32,
        total_frames=96,
        init_fn=record_init,  # the serial backend runs it in this process's threads
        post_collect_hook=lambda batch: started.append(batch.numel()),
        device=["cpu", "cpu"],
        worker_backend="serial",
    )
    assert collector.inner.closed is False
    with anyio.fail_after(30):
        async for data in collector:
            assert data["action"].dtype == torch.int64
    assert len(INIT_CALLS) == 2  # init_fn once per worker
    assert sum(started) == 96
    assert collector.inner.closed
    with pytest.raises(StopAsyncIteration):
        await collector.__anext__()
    await collector.shutdown()
    with pytest.raises(RuntimeError, match="was shut down"):
        await collector.set_seed(0)


async def test_policy_factory_leaves_no_weights_to_publish() -> None:
    collector = compat.MultiSyncCollector(
        [cartpole], policy_factory=make_policy, frames_per_batch=8, worker_backend="serial"
    )
    async with collector:
        with pytest.raises(TypeError, match="built by policy_factory"):
            await collector.update_policy_weights_()
    with pytest.raises(TypeError, match="mutually exclusive"):
        compat.Collector(cartpole, make_policy(), policy_factory=make_policy, frames_per_batch=8)


async def test_async_with_and_start_into_a_replay_buffer() -> None:
    rb = ListBuffer()
    collector = compat.MultiSyncCollector(
        [cartpole] * 2, frames_per_batch=32, replay_buffer=rb, worker_backend="serial"
    )
    async with collector:
        await collector.start()
        with anyio.fail_after(30):
            await rb.wait_for(2)
        async with collector.pause():
            pass
    assert collector.inner.closed
    assert all(b.batch_size == (32,) for b in rb.batches)  # frames, not [workers, T] rows (as torchrl)


async def test_iterating_into_a_replay_buffer_yields_none_without_a_warning() -> None:
    """TorchRL's behaviour: ``async for`` yields ``None`` per batch (aiocollect's own collectors warn and
    point at ``fill()``)."""
    rb = ListBuffer()
    collector = compat.SyncDataCollector(cartpole, frames_per_batch=8, total_frames=16, replay_buffer=rb)
    with anyio.fail_after(30):
        yielded = [data async for data in collector]
    assert yielded == [None, None]
    assert len(rb.batches) == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"weight_sync_schemes": {}},
            TypeError,
            "weight_sync_schemes= is not supported.*update_policy_weights_",
        ),
        ({"weight_updater": object()}, TypeError, "weight_updater"),
        ({"interruptor": object()}, TypeError, "preemptive_threshold"),
        ({"num_collectors": 2}, TypeError, "no metaclass"),
        ({"backend": "process"}, TypeError, "dispatch is not implemented"),
        ({"reset_when_done": False}, ValueError, "reset_when_done"),
        ({"track_traj_ids": False}, TypeError, "always written"),
        ({"compact_obs": True}, TypeError, "postproc"),
        ({"cudagraph_policy": True}, TypeError, "CudaGraphModule"),
        ({"extend_buffer": False}, TypeError, "extend_buffer"),
        ({"no_such_keyword": 1}, TypeError, "no_such_keyword"),
    ],
)
def test_unsupported_keywords_say_what_to_do(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        compat.Collector(cartpole, frames_per_batch=8, **kwargs)


def test_multi_keyword_checks() -> None:
    with pytest.raises(TypeError, match="num_workers"):
        compat.MultiSyncCollector(cartpole, frames_per_batch=8)
    with pytest.raises(ValueError, match="num_workers=3 but 2"):
        compat.MultiSyncCollector([cartpole] * 2, num_workers=3, frames_per_batch=8)
    with pytest.raises(TypeError, match="per-worker devices"):
        compat.MultiSyncCollector([cartpole] * 2, device=["cpu", "meta"], frames_per_batch=8)
    with pytest.raises(TypeError, match="pre_collect_hook"):
        compat.MultiAsyncCollector([cartpole] * 2, pre_collect_hook=lambda: None, frames_per_batch=8)
    with pytest.raises(TypeError, match="preemptive_threshold applies to MultiSyncCollector"):
        compat.MultiAsyncCollector([cartpole] * 2, preemptive_threshold=0.5, frames_per_batch=8)
    with pytest.raises(TypeError, match="sync must be True or False"):
        compat.MultiCollector([cartpole] * 2, sync=None, frames_per_batch=8)
    assert isinstance(
        compat.MultiCollector([cartpole], sync=True, frames_per_batch=8, worker_backend="serial"),
        compat.MultiSyncCollector,
    )


def test_sync_iteration_and_missing_methods_explain_themselves() -> None:
    collector = compat.Collector(cartpole, frames_per_batch=8)
    with pytest.raises(TypeError, match="async for"):
        iter(collector)
    with pytest.raises(AttributeError, match=r"map_fn is not available.*multi-process collectors have"):
        collector.map_fn  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nothing_like_this'"):
        collector.nothing_like_this  # noqa: B018
    anyio.run(collector.shutdown)


def test_split_trajectories_takes_torchrl_keywords() -> None:
    td = TensorDict(
        {"x": torch.arange(6.0), ("collector", "traj_ids"): torch.tensor([0, 0, 1, 1, 1, 2])}, batch_size=[6]
    )
    out = compat.split_trajectories(td, prefix="collector")
    assert out["collector", "mask"].sum(-1).tolist() == [2, 3, 1]
    with pytest.raises(TypeError, match="as_nested"):
        compat.split_trajectories(td, as_nested=True)


async def test_compat_update_policy_weights_waits_for_the_workers() -> None:
    """torchrl's meaning: the call returns once every worker runs the new weights; the native
    ``update_weights`` keeps returning at publication (``wait=False``)."""
    collector = compat.MultiSyncCollector([cartpole] * 2, make_policy(), frames_per_batch=8)
    with anyio.fail_after(60):
        async with collector:
            await collector.next()
            native = await collector.inner.update_weights()  # idle sync workers load at their next batch
            assert [w.policy_version for w in collector.statistics().workers] == [0, 0]
            version = await collector.update_policy_weights_()
            assert version == native + 1
            assert [w.policy_version for w in collector.statistics().workers] == [version] * 2
            assert await collector.update_policy_weights_(wait=False) == version + 1


@pytest.mark.parametrize("name", ["SyncDataCollector", "MultiSyncDataCollector", "MultiaSyncDataCollector"])
async def test_the_final_checkpoint_after_the_loop(name: str) -> None:
    """TorchRL's users save ``state_dict()`` after the loop (which has shut the collector down): it is the
    final state, and a new collector resumes from it."""
    cls = getattr(compat, name)
    kwargs = {} if name == "SyncDataCollector" else {"num_workers": 1, "worker_backend": "serial"}
    policy = make_policy()
    collector = cls(cartpole, policy, frames_per_batch=16, total_frames=32, **kwargs)
    with anyio.fail_after(60):
        first = [b async for b in collector]
        assert collector.inner.closed
        state = await collector.state_dict()
        assert state["frames"] == 32 and state["batches"] == 2
        resumed = cls(cartpole, make_policy(), frames_per_batch=16, total_frames=64, **kwargs)
        await resumed.load_state_dict(state)
        second = [b async for b in resumed]
    assert len(first) == len(second) == 2  # the budget goes on from the saved 32 frames
    assert resumed.stats()["frames"] == 64 and (await resumed.state_dict())["frames"] == 64
    seen = torch.cat([b["collector", "traj_ids"] for b in first])
    later = torch.cat([b["collector", "traj_ids"] for b in second])
    assert int(later.min()) > int(seen.max())  # trajectory ids go on, never reused


async def test_shutdown_keeps_the_final_state_and_an_error_does_not() -> None:
    collector = compat.SyncDataCollector(cartpole, make_policy(), frames_per_batch=16, total_frames=-1)
    with anyio.fail_after(60):
        await collector.next()
        await collector.shutdown()
        assert (await collector.state_dict())["frames"] == 16
    failing = compat.SyncDataCollector(
        cartpole, make_policy(), frames_per_batch=16, total_frames=-1, postproc=_fail
    )
    with anyio.fail_after(60):
        with pytest.raises(LookupError):
            await failing.next()
        with pytest.raises(RuntimeError, match="was shut down"):
            await failing.state_dict()


def _fail(batch: TensorDict) -> TensorDict:
    raise LookupError("postproc failed")

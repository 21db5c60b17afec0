"""Logging sinks: ``await collector.add_sink(sink)`` writes ``statistics()`` and ``log_metrics`` on a schedule
in a worker thread; read back from TensorBoard's event files and from a W&B offline run directory."""

from __future__ import annotations

import json
import logging
import struct
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from aiocollect import Collector, CollectorStatistics, MetricsLogged, MultiSyncCollector, Sink
from support import cartpole2 as cartpole

pytestmark = pytest.mark.anyio


class Policy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return torch.distributions.Categorical(logits=self.linear(observation)).sample()


class Recording(Sink):
    """Remembers what it was asked to do, and on which thread; ``gate`` (if set) holds each write."""

    def __init__(self, every: float = 0.02, gate: threading.Event | None = None, fail: str = "") -> None:
        super().__init__(every=every)
        self.calls: list[str] = []
        self.stats: list[CollectorStatistics] = []
        self.metrics: list[MetricsLogged] = []
        self.threads: set[int] = set()
        self.gate = gate
        self.fail = fail
        self.writing = threading.Event()  # a write has started (and waits on ``gate``, if any)

    def open(self) -> None:
        self.threads.add(threading.get_ident())
        self.calls.append("open")
        if self.fail == "open":
            raise PermissionError("no writing there")

    def write(self, statistics: CollectorStatistics | None, metrics: list[MetricsLogged]) -> None:
        self.threads.add(threading.get_ident())
        self.writing.set()
        if self.gate is not None:
            assert self.gate.wait(60)  # only stops a hang
        self.calls.append("write")
        if self.fail == "write":
            raise OSError("disk full")
        if statistics is not None:
            self.stats.append(statistics)
        self.metrics.extend(metrics)

    def close(self) -> None:
        self.calls.append("close")


async def test_a_sink_writes_on_schedule_and_closes_with_the_collector():
    sink = Recording()
    async with Collector(cartpole, Policy(), frames_per_batch=64, total_frames=640) as c:
        await c.add_sink(sink)
        assert sink.calls == ["open"]
        step = 0
        async for _ in c:
            step += 1
            c.log_metrics({"loss": 1.0 / step}, step=step)
            if step == 5:
                with anyio.fail_after(10):
                    while not sink.stats:  # noqa: ASYNC110 - the schedule writes within `every`
                        await anyio.sleep(0.01)
    assert sink.calls[0] == "open" and sink.calls[-1] == "close" and sink.calls.count("close") == 1
    assert threading.get_ident() not in sink.threads  # never on the loop's thread
    assert [m.step for m in sink.metrics] == list(range(1, 11))  # every metric, once, in order
    assert [m.frames for m in sink.metrics] == [64 * i for i in range(1, 11)]
    assert sink.stats[-1].frames == 640  # the last write is the final count
    assert [w.state for w in sink.stats[-1].workers] == ["stopped"]
    frames = [s.frames for s in sink.stats]
    assert frames == sorted(set(frames))  # nothing written twice while nothing changed


async def test_a_slow_sink_never_holds_collection():
    gate = threading.Event()
    sink = Recording(gate=gate)
    async with MultiSyncCollector(
        [cartpole, cartpole], Policy(), frames_per_batch=64, worker_backend="serial"
    ) as c:
        await c.add_sink(sink)
        with anyio.fail_after(20):
            await anyio.to_thread.run_sync(sink.writing.wait)  # the first write started: it waits on the gate
            before = c.statistics().batches
            for _ in range(10):
                await c.__anext__()
            assert c.statistics().batches == before + 10 and "write" not in sink.calls
            gate.set()
    assert sink.calls[-1] == "close" and "write" in sink.calls


async def test_sink_errors(caplog: pytest.LogCaptureFixture):
    collector = Collector(cartpole, Policy(), frames_per_batch=64)
    with pytest.raises(RuntimeError, match="entered collector"):
        await collector.add_sink(Recording())
    async with collector as c:
        failing = Recording(fail="open")
        with pytest.raises(PermissionError, match="no writing there"):  # its own type, from add_sink
            await c.add_sink(failing)
        assert not c._hub.active  # its subscription was dropped
        broken = Recording(fail="write")
        await c.add_sink(broken)
        with pytest.raises(RuntimeError, match="one sink per collector"):
            await c.add_sink(broken)
        with caplog.at_level(logging.ERROR, logger="aiocollect.sinks"), anyio.fail_after(10):
            while "write" not in broken.calls:  # its schedule's first write (a poll: no event for it)
                await c.__anext__()
                await anyio.sleep(0.03)
            for _ in range(3):
                await c.__anext__()  # collection goes on
    assert "could not write" in caplog.text and "disk full" in caplog.text
    assert broken.calls[-1] == "close"
    with pytest.raises(ValueError, match="every must be a positive number"):
        Recording(every=0)


# -- TensorBoard ---------------------------------------------------------------------------------------
async def test_tensorboard_sink_event_files(tmp_path: Path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from aiocollect import TensorBoardSink

    with pytest.raises(ValueError, match="step must be"):
        TensorBoardSink(tmp_path, step="epochs")
    logdir = tmp_path / "run"
    async with Collector(cartpole, Policy(), frames_per_batch=64, total_frames=640) as c:
        sink = TensorBoardSink(logdir, every=0.05)
        await c.add_sink(sink)
        step = 0
        async for _ in c:
            step += 1
            c.log_metrics({"train/loss": 1.0 / step, "train/kl": 0.01}, step=step)
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"collector/frames_per_second", "collector/mean_return", "collector/episodes"} <= tags
    assert {"train/loss", "train/kl"} <= tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [64 * i for i in range(1, 11)]  # x: frames collected
    assert [e.value for e in loss] == pytest.approx([1.0 / i for i in range(1, 11)])
    episodes = acc.Scalars("collector/episodes")
    assert episodes[-1].step == 640 and episodes[-1].value == c.statistics().episodes > 0


# -- Weights & Biases, offline --------------------------------------------------------------------------
def wandb_records(run_dir: Path) -> list[Any]:
    """The records of an offline run's ``run-*.wandb`` file (W&B's LevelDB-style log of protobufs: a
    7-byte file header, then 32 KiB blocks of records, each with a 7-byte header: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, partial = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # padding to the end of the block
            pos += left
            continue
        if pos + 7 + length > len(data):  # being written
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):  # full, or the last piece
            record = pb.Record()
            record.ParseFromString(partial)
            records.append(record)
    return records


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in wandb_records(run_dir)
        if r.WhichOneof("record_type") == "history"
    ]


@pytest.mark.wandb  # nox -s sinks: the default suite has no wandb
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # wandb's service: one backend is enough
async def test_wandb_sink_offline_run(tmp_path: Path):
    pytest.importorskip("wandb")
    from aiocollect import WandbSink

    with pytest.raises(ValueError, match="mode must be"):
        WandbSink(project="p", mode="cloud")
    async with Collector(cartpole, Policy(), frames_per_batch=64, total_frames=640) as c:
        sink = WandbSink(project="aiocollect-test", dir=tmp_path, every=0.05, config={"lr": 3e-4})
        await c.add_sink(sink)
        step = 0
        async for _ in c:
            step += 1
            c.log_metrics({"loss": 1.0 / step}, step=step)
    assert sink.run_ is None  # finished
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    with anyio.fail_after(30):  # W&B's service writes the file on its own: wait for the run's end record
        while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(run_dir)):  # noqa: ASYNC110
            await anyio.sleep(0.1)
    history = wandb_history(run_dir)
    losses = [h for h in history if "loss" in h]
    assert [h["trainer/step"] for h in losses] == list(range(1, 11))
    assert [h["frames"] for h in losses] == [64 * i for i in range(1, 11)]
    stats = [h for h in history if "collector/frames_per_second" in h]
    assert stats and stats[-1]["frames"] == 640 and stats[-1]["collector/episodes"] > 0

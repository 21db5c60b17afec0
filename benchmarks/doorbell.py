"""Round trip parent -> worker process -> parent: our socket doorbell vs aiomultiprocess.

Why the multi-process collectors do not put aiomultiprocess on the per-batch path: a batch notice is one
small message from a worker, and its latency adds to every batch. Both variants run in one run, on the
same machine; the table reports medians and the ratio.

    python benchmarks/doorbell.py            # needs: pip install aiomultiprocess
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

import anyio

from aiocollect._transport._wire import AsyncChannel, BlockingChannel


def echo_worker(sock: socket.socket) -> None:
    chan = BlockingChannel(sock)
    try:
        while True:
            chan.send(chan.recv())
    except EOFError:
        pass


async def echo(x: int) -> int:
    return x


async def doorbell_round_trips(n: int) -> list[float]:
    parent, child = socket.socketpair()
    proc = mp.get_context("forkserver").Process(target=echo_worker, args=(child,), daemon=True)
    await anyio.to_thread.run_sync(proc.start)
    child.close()
    chan = AsyncChannel(parent)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        await chan.send(i)
        assert await chan.receive() == i
        times.append(time.perf_counter() - t0)
    chan.close()
    await anyio.to_thread.run_sync(proc.join)
    return times


async def aiomultiprocess_round_trips(n: int) -> list[float]:
    import aiomultiprocess

    times = []
    async with aiomultiprocess.Pool(processes=1) as pool:
        await pool.apply(echo, (0,))
        for i in range(n):
            t0 = time.perf_counter()
            assert await pool.apply(echo, (i,)) == i
            times.append(time.perf_counter() - t0)
    return times


async def main(n: int) -> None:
    rows = {}
    for _ in range(3):  # interleaved rounds: this machine's speed drifts
        rows.setdefault("aiocollect socket doorbell", []).extend(await doorbell_round_trips(n))
        rows.setdefault("aiomultiprocess Pool.apply", []).extend(await aiomultiprocess_round_trips(n))
    base = statistics.median(rows["aiocollect socket doorbell"])
    print(f"{'variant':32} {'median us':>10} {'p99 us':>10} {'ratio':>7}")
    for name, times in rows.items():
        times.sort()
        med = statistics.median(times)
        p99 = times[int(0.99 * (len(times) - 1))]
        print(f"{name:32} {med * 1e6:10.0f} {p99 * 1e6:10.0f} {med / base:7.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=300, help="round trips per variant and round")
    anyio.run(main, parser.parse_args().n)

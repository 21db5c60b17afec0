"""Benchmark: ``RayCollector`` (2 Ray actors) against ``MultiSyncCollector`` (2 worker processes), measured
in one run on one local Ray cluster.

Run with ``python benchmarks/ray.py [--quick] [--json PATH]`` (needs ``pip install 'aiocollect[ray]'``).

Setting: CartPole-v1, 2 actors (or 2 workers) x ``GymEnv("CartPole-v1", num_envs=32)``, an MLP policy
(obs -> 64 -> 64 -> 2 logits, tanh, argmax; an ``nn.Module``), ``frames_per_batch=4096`` (so 2048 per
actor and per batch with ``sync=True``; 4096 per actor batch with ``sync=False``). The local cluster is
``ray.init(address="local", num_cpus=2, include_dashboard=False)`` bound to 127.0.0.1; each actor asks for
half a CPU (both RayCollectors are entered at once; one collects at a time). Measured:

1. throughput: frames/s of ``RayCollector(sync=True)``, ``RayCollector(sync=False)``,
   ``MultiSyncCollector`` and ``MultiAsyncCollector``, all entered at once and measured in turn (each for
   ``--seconds``, over ``--rounds`` rounds, the order reversed every other round); ratios are medians of
   per-round ratios to ``MultiSyncCollector`` (this shared machine's speed drifts: compare numbers taken
   seconds apart). The idle collectors cost nothing meanwhile (their actors and workers wait for a
   request, or hold a batch ahead); the async ones' batches collected ahead while another was measured
   are consumed before their clock starts.
2. bytes on the wire: the pickled size of one delivered batch (what an actor returns through the
   object store) and of one weight update (the dict ``update_weights`` puts), small and large policy.
3. weight updates: the latency of ``await update_weights()`` (put once in the object store; the actors
   fetch it with their next request) and ``await update_weights(wait=True)`` (plus every actor loading
   it, acknowledged) between batches, for the small MLP and a ~1M-parameter one (obs -> 1000 -> 1000 ->
   2), against ``MultiSyncCollector``'s (shared memory) in the same run.
4. start-up: ``ray.init`` of a local cluster, and entering a ``RayCollector`` (2 actors: a Python
   process each, importing torch) against entering a ``MultiSyncCollector``; and the trainer's event-loop
   lag over the throughput part (``statistics().loop_lag_ms``: one loop, shared by all the collectors).
5. the fixed cost of one batch: batches of one frame per actor (``GymEnv("CartPole-v1")``), i.e. a
   request, one env step, the reply through the object store and the merge, against the same with
   ``MultiSyncCollector`` (a control message, one step, the shared-memory copy).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import platform
import statistics
import sys
import time
from typing import Any

import anyio
import torch
from torch import nn

from aiocollect import GymEnv, MultiAsyncCollector, MultiSyncCollector, RayCollector
from aiocollect._policies._weights import flat_weights
from aiocollect._remote._ray_wire import to_wire, weights_to_wire

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# this file is named ray.py: keep its folder off sys.path, or `import ray` (here, and in the actors, to
# which Ray passes the driver's script folder) would import this file instead of Ray
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

ENV_ID = "CartPole-v1"
N = 2
ENVS = 32
FRAMES_PER_BATCH = 4096
BIG_HIDDEN = 1000


class MLPPolicy(nn.Module):
    """obs -> hidden -> hidden -> 2 logits (tanh), argmax: returns CartPole's action."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, 2)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(observation)).argmax(-1)


def make_env() -> GymEnv:
    return GymEnv(ENV_ID, num_envs=ENVS)


def make_single_env() -> GymEnv:
    return GymEnv(ENV_ID)


def params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


async def frames_per_second(collector: Any, seconds: float, skip: int) -> float:
    """Consume ``skip`` batches (prefetched ones), then batches for ``seconds``: frames/s."""
    for _ in range(skip):
        await collector.__anext__()
    frames, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or frames == 0:
        batch = await collector.__anext__()
        frames += batch.numel()
    return frames / (time.perf_counter() - start)


async def latency_ms(fn: Any, reps: int) -> dict[str, float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        await fn()
        times.append((time.perf_counter() - start) * 1e3)
    return {"median": statistics.median(times), "max": max(times)}


async def timed_enter(collector: Any, stack: contextlib.AsyncExitStack) -> float:
    start = time.perf_counter()
    await stack.enter_async_context(collector)
    return time.perf_counter() - start


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from aiocollect._remote._ray_local import init_local

    out: dict[str, Any] = {}
    start = time.perf_counter()
    init_local(  # ray.init kept on loopback (Ray would move 127.0.0.1 to the machine's address)
        ray,
        {
            "address": "local",
            "num_cpus": N,
            "include_dashboard": False,
            "object_store_memory": 200 * 2**20,
            "configure_logging": False,
            "log_to_driver": False,
            "_node_ip_address": "127.0.0.1",
        },
    )
    out["ray_init_s"] = time.perf_counter() - start
    try:
        small = MLPPolicy()
        big = MLPPolicy(BIG_HIDDEN)
        # half a CPU per actor: both RayCollectors (4 actors) fit in the 2-CPU cluster at once; the
        # benchmark runs one collector at a time, so each actor still gets a core when it collects
        common = {
            "frames_per_batch": FRAMES_PER_BATCH,
            "num_collectors": N,
            "progress": False,
            "remote_config": {"num_cpus": 0.5},
        }
        collectors = {
            "ray sync": RayCollector(make_env, small, sync=True, **common),
            "ray async": RayCollector(make_env, small, sync=False, **common),
            "multi sync": MultiSyncCollector([make_env] * N, small, frames_per_batch=FRAMES_PER_BATCH),
            "multi async": MultiAsyncCollector([make_env] * N, small, frames_per_batch=FRAMES_PER_BATCH),
        }
        startup = {}
        async with contextlib.AsyncExitStack() as stack:  # left in reverse order: task groups nest
            for name, c in collectors.items():
                startup[name] = await timed_enter(c, stack)
            out["startup_s"] = startup
            # -- throughput, interleaved --------------------------------------------------------------
            for c in collectors.values():  # warm-up batch each
                await c.__anext__()
            rates: dict[str, list[float]] = {name: [] for name in collectors}
            names = list(collectors)
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    # batches collected ahead while another collector was measured: an actor holds
                    # one, a MultiAsyncCollector worker up to two (its two slots)
                    skip = {"ray async": N, "multi async": 2 * N}.get(name, 0)
                    rates[name].append(await frames_per_second(collectors[name], args.seconds, skip))
            base = rates["multi sync"]
            out["throughput"] = {
                name: {
                    "frames_per_s": statistics.median(v),
                    "ratio_to_multi_sync": statistics.median(x / b for x, b in zip(v, base, strict=True)),
                    "ratios_per_round": [round(x / b, 3) for x, b in zip(v, base, strict=True)],
                }
                for name, v in rates.items()
            }
            out["loop_lag_ms_ray_sync"] = collectors["ray sync"].statistics().loop_lag_ms

            # -- bytes on the wire ----------------------------------------------------------------------
            ray_batch = await collectors["ray async"].__anext__()
            # what the actors send and the trainer puts: numpy arrays, pickled (protocol 5) by Ray
            out["bytes"] = {
                "batch_per_actor": len(pickle.dumps(to_wire(ray_batch), protocol=5)),
                "frames_per_actor_batch": ray_batch.numel(),
                "weights_small": len(pickle.dumps(weights_to_wire(flat_weights(small)), protocol=5)),
                "weights_big": len(pickle.dumps(weights_to_wire(flat_weights(big)), protocol=5)),
                "params_small": params(small),
                "params_big": params(big),
            }

            # -- weight updates, small policy (between batches: actors and workers idle) ----------------
            weights: dict[str, Any] = {}
            for name in ("ray sync", "multi sync"):
                c = collectors[name]
                weights[f"{name} small"] = {
                    "put": await latency_ms(c.update_weights, args.reps),
                    "wait": await latency_ms(lambda c=c: c.update_weights(wait=True), args.reps),
                }
                await c.__anext__()  # the pending weights go with the next request

        # -- weight updates, ~1M-parameter policy ---------------------------------------------------------
        big_collectors = {
            "ray sync": RayCollector(make_env, big, sync=True, **common),
            "multi sync": MultiSyncCollector([make_env] * N, big, frames_per_batch=FRAMES_PER_BATCH),
        }
        async with contextlib.AsyncExitStack() as stack:
            for c in big_collectors.values():
                await stack.enter_async_context(c)
            for name, c in big_collectors.items():
                await c.__anext__()
                weights[f"{name} big"] = {
                    "put": await latency_ms(c.update_weights, args.reps),
                    "wait": await latency_ms(lambda c=c: c.update_weights(wait=True), args.reps),
                }
                # check: the workers run what was published (a constant action)
                with torch.no_grad():
                    big.head.bias.copy_(torch.tensor([0.0, 1e6]))
                await c.update_weights(wait=True)
                batch = await c.__anext__()
                weights[f"{name} big"]["check"] = bool((batch["action"] == 1).all())
                with torch.no_grad():
                    big.head.bias.zero_()
        out["weights_ms"] = weights

        # -- the fixed cost of one batch: 1 frame per actor / worker ------------------------------------
        tiny = {
            "ray sync": RayCollector(make_single_env, small, sync=True, **{**common, "frames_per_batch": N}),
            "ray async": RayCollector(
                make_single_env, small, sync=False, **{**common, "frames_per_batch": 1}
            ),
            "multi sync": MultiSyncCollector([make_single_env] * N, small, frames_per_batch=N),
        }
        async with contextlib.AsyncExitStack() as stack:
            for c in tiny.values():
                await stack.enter_async_context(c)
            per_batch: dict[str, list[float]] = {name: [] for name in tiny}
            for c in tiny.values():
                await c.__anext__()
            for r in range(args.rounds):
                for name in list(tiny) if r % 2 == 0 else list(tiny)[::-1]:
                    c = tiny[name]
                    start, n = time.perf_counter(), 0
                    while time.perf_counter() - start < args.seconds / 3 or n < 5:
                        await c.__anext__()
                        n += 1
                    per_batch[name].append((time.perf_counter() - start) / n * 1e3)
        out["batch_round_trip_ms"] = {name: statistics.median(v) for name, v in per_batch.items()}
    finally:
        ray.shutdown()
    return out


def report(res: dict[str, Any]) -> None:
    print(f"\nray.init (local cluster): {res['ray_init_s']:.1f} s")
    print(
        "start-up (entering the collector): "
        + ", ".join(f"{k} {v:.1f} s" for k, v in res["startup_s"].items())
    )
    print("\n| collector | frames/s | ratio to MultiSyncCollector (min-max over rounds) |\n|---|---:|---:|")
    for name, v in res["throughput"].items():
        lo, hi = min(v["ratios_per_round"]), max(v["ratios_per_round"])
        print(f"| {name} | {v['frames_per_s']:,.0f} | {v['ratio_to_multi_sync']:.2f} ({lo:.2f}-{hi:.2f}) |")
    b = res["bytes"]
    print(
        f"\nbytes: one actor batch ({b['frames_per_actor_batch']} frames) {b['batch_per_actor']:,} B "
        f"({b['batch_per_actor'] / b['frames_per_actor_batch']:.0f} B/frame); weights "
        f"{b['params_small']:,} params {b['weights_small']:,} B, "
        f"{b['params_big']:,} params {b['weights_big']:,} B"
    )
    print("\n| update_weights | put (median / max ms) | wait=True (median / max ms) |\n|---|---:|---:|")
    for name, v in res["weights_ms"].items():
        check = "" if "check" not in v else f" (check {'ok' if v['check'] else 'FAILED'})"
        print(
            f"| {name}{check} | {v['put']['median']:.1f} / {v['put']['max']:.1f} | "
            f"{v['wait']['median']:.1f} / {v['wait']['max']:.1f} |"
        )
    print(
        "\none batch of 1 frame per actor or worker (the fixed cost of a batch), median ms: "
        + ", ".join(f"{k} {v:.2f}" for k, v in res["batch_round_trip_ms"].items())
    )
    lag = res["loop_lag_ms_ray_sync"]
    print(
        f"\nthe trainer's event-loop lag over the throughput part: p50 {lag['p50']:.1f} ms, "
        f"p99 {lag['p99']:.1f} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 1 s, 5 updates")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds, args.reps = 2, 1.0, 5
    torch.set_num_threads(1)
    started = time.perf_counter()
    res = anyio.run(run, args)
    res["machine"] = {
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": __import__("ray").__version__,
        "args": vars(args),
        "wall_s": time.perf_counter() - started,
    }
    report(res)
    print(f"\nload average {res['machine']['load_avg']}, {res['machine']['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    checks = [v["check"] for v in res["weights_ms"].values() if "check" in v]
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())

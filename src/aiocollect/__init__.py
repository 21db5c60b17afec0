"""aiocollect: asyncio-native reinforcement-learning data collectors.

``async for batch in collector`` yields ``tensordict.TensorDict`` batches with TorchRL's key conventions,
while the env and the policy run off the event loop.
"""

from __future__ import annotations

import typing

from ._workers import _preload  # noqa: F401  (first: imports tensordict without torch._dynamo)

# isort: split

from ._asyncenv._collector import AsyncEnvCollector
from ._asyncenv._multi import MultiAsyncEnvCollector
from ._core._checkpoints import CheckpointError, load_checkpoint, save_checkpoint
from ._core._errors import CollectorClosedError, WorkerDiedError, WorkerError, WorkerTimeoutError
from ._core._options import RolloutOptions, WeightSchedule
from ._core._restart import RestartPolicy
from ._core._signals import SignalStop, stop_on_signals
from ._envs._async import AsyncEnvProtocol, AsyncVectorEnvProtocol, ThreadedAsyncEnv
from ._envs._async_vector import ThreadedAsyncVectorEnv
from ._envs._gym import GymEnv
from ._envs._multiagent._pettingzoo import PettingZooEnv
from ._envs._multiagent._vmas import VmasEnv
from ._envs._protocol import EnvProtocol
from ._episodes._assembler import EpisodeStatistics
from ._episodes._trajectories import split_trajectories
from ._local._collector import Collector
from ._multi import (
    MultiAsyncCollector,
    MultiCollector,
    MultiSyncCollector,
    ProcessCollector,
    set_worker_warnings,
)
from ._observe._events import (
    BatchDelivered,
    EpisodeFinished,
    Event,
    EventStream,
    MetricsLogged,
    Paused,
    Restarted,
    Resumed,
    WeightsLoaded,
    WeightsPublished,
    WorkerFailed,
    WorkerStarted,
    WorkerStopped,
)
from ._observe._metrics import metrics_text
from ._observe._sinks import Sink, TensorBoardSink, WandbSink
from ._observe._stats import CollectorStatistics, WorkerState, WorkerStatistics
from ._policies._group_policy import GroupPolicy
from ._policies._runners import RandomPolicy
from ._procenv import ProcessVectorEnv
from ._weightsync._distributed import DistributedWeightSync
from ._weightsync._schemes import (
    PipeWeightSync,
    SharedMemoryWeightSync,
    WeightReceiver,
    WeightSender,
    WeightSync,
)

if typing.TYPE_CHECKING:  # the lazy names below, for type checkers (imported on first use at run time)
    from ._remote._gloo import DistributedCollector, DistributedSyncCollector
    from ._remote._launchers import submitit_delayed_launcher
    from ._remote._ray import RayCollector
    from ._remote._rpc import RPCCollector
    from ._serve import (
        EnvServer,
        EnvServerProcess,
        PolicyServer,
        PooledRemoteEnv,
        RemoteConnectionError,
        RemoteEnv,
        RemoteEnvPool,
        RemotePolicy,
        RemoteVectorEnv,
        serve_envs,
        serve_envs_process,
        serve_policy,
    )

__version__ = "0.1.0"

#: names exported lazily (``__getattr__``): their modules load on first use, so ``import aiocollect``
#: never imports an optional engine (``RayCollector`` imports ray only when a collector is entered)
_LAZY = {
    "RayCollector": "._remote._ray",
    "DistributedCollector": "._remote._gloo",
    "DistributedSyncCollector": "._remote._gloo",
    "RPCCollector": "._remote._rpc",
    # submitit is imported when the decorator is called, never by import
    "submitit_delayed_launcher": "._remote._launchers",
    # the serve extra (wsproto) is imported on first use of these
    **dict.fromkeys(
        ["EnvServer", "EnvServerProcess", "PolicyServer", "PooledRemoteEnv", "RemoteConnectionError"]
        + ["RemoteEnv", "RemoteEnvPool", "RemotePolicy", "serve_envs", "serve_envs_process", "serve_policy"]
        + ["RemoteVectorEnv"],
        "._serve",
    ),
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AsyncEnvCollector",
    "AsyncEnvProtocol",
    "AsyncVectorEnvProtocol",
    "BatchDelivered",
    "CheckpointError",
    "Collector",
    "CollectorClosedError",
    "CollectorStatistics",
    "DistributedCollector",
    "DistributedSyncCollector",
    "DistributedWeightSync",
    "EnvProtocol",
    "EpisodeFinished",
    "EpisodeStatistics",
    "Event",
    "EventStream",
    "GroupPolicy",
    "GymEnv",
    "MultiAsyncCollector",
    "MultiAsyncEnvCollector",
    "MultiCollector",
    "MultiSyncCollector",
    "Paused",
    "PettingZooEnv",
    "PipeWeightSync",
    "ProcessCollector",
    "ProcessVectorEnv",
    "RandomPolicy",
    "RPCCollector",
    "RayCollector",
    "RestartPolicy",
    "Restarted",
    "Resumed",
    "RolloutOptions",
    "SharedMemoryWeightSync",
    "SignalStop",
    "ThreadedAsyncEnv",
    "ThreadedAsyncVectorEnv",
    "VmasEnv",
    "WorkerDiedError",
    "WorkerError",
    "WorkerFailed",
    "WorkerStarted",
    "WorkerState",
    "WorkerStatistics",
    "WorkerStopped",
    "WorkerTimeoutError",
    "WeightReceiver",
    "WeightsLoaded",
    "WeightsPublished",
    "WeightSender",
    "WeightSync",
    "WeightSchedule",
    "MetricsLogged",
    "Sink",
    "TensorBoardSink",
    "WandbSink",
    "load_checkpoint",
    "metrics_text",
    "__version__",
    "save_checkpoint",
    "set_worker_warnings",
    "split_trajectories",
    "stop_on_signals",
    "submitit_delayed_launcher",
    # serve (issue 16): envs and policies over WebSocket
    "EnvServer",
    "EnvServerProcess",
    "PolicyServer",
    "PooledRemoteEnv",
    "RemoteConnectionError",
    "RemoteEnv",
    "RemoteEnvPool",
    "RemotePolicy",
    "RemoteVectorEnv",
    "serve_envs",
    "serve_envs_process",
    "serve_policy",
]

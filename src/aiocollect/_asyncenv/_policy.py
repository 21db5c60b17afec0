"""The policy side of ``AsyncEnvCollector``: one call per batch of ready envs (a torch policy in the
collector's own thread, an async policy awaited on the loop), a worker's random first actions, and the
conversion of its actions into what each env's ``step`` takes."""

from __future__ import annotations

import copy
import functools
import inspect
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import InteractionType, set_interaction_type

from .._core._rng import RolloutRNG
from .._envs._spaces import (
    NestedKey,
    action_bounds,
    action_leaf_spaces,
    action_outside_space,
    assemble_action,
)
from .._policies._runners import RandomPolicy, make_runner
from .._policies._weights import as_weights, check_compatible, copy_weights, module_weights
from ._policy_thread import PolicyThread

__all__ = ["ActionCodec", "BatchPolicy", "DeviceStaging", "RandomFirst", "is_async_policy"]

_MIN, _MAX = np.minimum.reduce, np.maximum.reduce


def is_async_policy(policy: Any) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one (not an ``nn.Module``)."""
    if policy is None or isinstance(policy, torch.nn.Module):
        return False
    if inspect.iscoroutinefunction(policy):
        return True
    try:
        call = type(policy).__call__  # a class's own or inherited async __call__
    except AttributeError:
        return False
    return inspect.iscoroutinefunction(call)


def _parameter_device(policy: Any) -> torch.device | None:
    """The device of a module's parameters when it is not the CPU (``None``: leave inputs where they are)."""
    if not isinstance(policy, torch.nn.Module):
        return None
    param = next(iter(policy.parameters()), None)
    if param is None or param.device.type == "cpu":
        return None
    return param.device


class DeviceStaging:
    """Observations to ``device`` in one host-to-device copy per policy call: every key's rows are packed
    into one host buffer (pinned for CUDA, so the copy is asynchronous; reused from call to call, grown to
    the largest call), copied with one non-blocking ``.to``, and viewed per key on the device.

    Reusing the buffer is safe because the call's outputs are copied back (synchronously) before it
    returns: the copy out of the buffer, enqueued before them on the same stream, is done by then.

    Example:
        >>> import torch
        >>> staging = DeviceStaging(torch.device("cpu"))
        >>> on = staging.to_device({"observation": torch.ones(2, 4), "mask": torch.ones(2, dtype=torch.bool)})
        >>> on["observation"].shape, on["mask"].dtype
        (torch.Size([2, 4]), torch.bool)
    """

    _ALIGN = 64  # each key's block starts at a multiple of this (any dtype's alignment)

    def __init__(self, device: torch.device, *, pin: bool | None = None) -> None:
        self.device = device
        self.pin = device.type == "cuda" if pin is None else pin
        self.host: torch.Tensor | None = None  # uint8, the packed observations
        self.copies = 0  # host-to-device copies made (one per call)

    def to_device(self, obs: Mapping[NestedKey, torch.Tensor]) -> dict[NestedKey, torch.Tensor]:
        blocks, size = [], 0
        for value in obs.values():
            nbytes = value.numel() * value.element_size()
            blocks.append((size, nbytes))
            size += -(-nbytes // self._ALIGN) * self._ALIGN
        host = self.host
        if host is None or host.numel() < size:
            grown = size if host is None else max(size, 2 * host.numel())
            host = self.host = torch.empty(grown, dtype=torch.uint8, pin_memory=self.pin)
        for value, (start, nbytes) in zip(obs.values(), blocks, strict=True):
            host[start : start + nbytes].view(value.dtype).view(value.shape).copy_(value)
        on_device = host[:size].to(self.device, non_blocking=True)
        self.copies += 1
        return {
            key: on_device[start : start + nbytes].view(value.dtype).view(value.shape)
            for (key, value), (start, nbytes) in zip(obs.items(), blocks, strict=True)
        }


def _out_keys(out: TensorDictBase, obs_keys: set[NestedKey]) -> list[NestedKey]:
    """The policy's outputs: its new leaves, without private, ``next`` or ``collector`` entries."""
    keys = []
    for key in out.keys(include_nested=True, leaves_only=True):
        parts = (key,) if isinstance(key, str) else key
        if key in obs_keys or any(p.startswith("_") for p in parts) or parts[0] in ("next", "collector"):
            continue
        keys.append(key)
    return keys


class BatchPolicy:
    """Calls ``policy`` on ``{key: Tensor[k, ...]}`` observations and returns ``{key: Tensor[k, ...]}``.

    A torch policy (``nn.Module``, ``TensorDictModule``, a plain callable ``td -> td``, ``RandomPolicy``)
    runs in one long-lived thread (the torch settings of the thread that entered the collector), under
    ``torch.no_grad()`` and ``exploration_type``; an ``nn.Module`` is copied, so the collector runs its own
    weights. An async policy (see :func:`is_async_policy`) is awaited on the loop with a TensorDict.
    """

    def __init__(
        self,
        policy: Any,
        *,
        action_space: spaces.Space[Any],
        obs_keys: list[NestedKey],
        exploration_type: InteractionType,
        name: str,
    ) -> None:
        self.source = policy
        self.obs_keys = obs_keys
        self.exploration_type = exploration_type
        self.is_async = is_async_policy(policy)
        #: the collector's own torch generator (a seeded collector's: see ``_core/_rng.py``), swapped in
        #: around each torch call
        self.rng: RolloutRNG | None = None
        self._thread: PolicyThread | None = None
        self._calls = threading.Lock()  # held by a call, and by in_thread's work: one at a time
        self._out_keys: list[NestedKey] | None = None
        self.module: torch.nn.Module | None = None
        self.device: torch.device | None = None
        self.staging: DeviceStaging | None = None
        if self.is_async:
            self.policy = policy
            return
        if policy is None:
            policy = RandomPolicy(action_space)
        elif isinstance(policy, torch.nn.Module):
            try:
                policy = copy.deepcopy(policy)
            except Exception as exc:
                raise TypeError(
                    f"policy {type(policy).__name__} cannot be copied ({exc}); the collector needs its own "
                    "copy of the weights"
                ) from exc
            self.module = policy
        self.policy = policy
        # a module on an accelerator gets its inputs there (central inference on a GPU): in one copy per
        # call from a staging buffer, and its outputs back in one copy each
        device = self.device = _parameter_device(policy)
        self.staging = None if device is None else DeviceStaging(device)
        self._runner = make_runner(policy, batch_shape=(1,), obs_keys=obs_keys, device=device)
        # the TensorDict path builds its TensorDict with a batch size: ours changes at every call
        self._sized: Any = getattr(self._runner, "slow", self._runner)
        self._resized = hasattr(self._sized, "batch_shape")
        self._thread = PolicyThread(name)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread (a torch policy) with the calling thread's torch settings."""
        if self._thread is not None:
            self._thread.start()

    async def stop(self) -> None:
        """End the thread (after a call in flight); idempotent."""
        if self._thread is not None:
            await self._thread.stop()

    async def in_thread(self, fn: Any) -> Any:
        """Run ``fn()`` in the policy thread, between two policy calls (a lock keeps it from the calls
        the fused engine's driver makes in its own thread)."""
        assert self._thread is not None
        return await self._thread.call(lambda: self._between_calls(fn))

    def _between_calls(self, fn: Any) -> Any:
        with self._calls:
            return fn()

    # -- calls ------------------------------------------------------------------------------------
    async def __call__(self, obs: dict[NestedKey, torch.Tensor], n: int) -> dict[NestedKey, torch.Tensor]:
        if self.is_async:
            return await self._call_async(obs, n)
        assert self._thread is not None
        return await self._thread.call(lambda: self._call_torch(obs, n))

    def _call_torch(self, obs: dict[NestedKey, torch.Tensor], n: int) -> dict[NestedKey, torch.Tensor]:
        """The call, in the thread that runs the policy (the policy thread, or the fused engine's), drawing
        from :attr:`rng` when it is set."""
        with self._calls:
            if self.rng is not None:
                return self.rng.run(lambda: self._call_module(obs, n))
            return self._call_module(obs, n)

    def _call_module(self, obs: dict[NestedKey, torch.Tensor], n: int) -> dict[NestedKey, torch.Tensor]:
        if self._resized:
            self._sized.batch_shape = (n,)
        if self.staging is not None:
            obs = self.staging.to_device(obs)
        with torch.no_grad(), set_interaction_type(self.exploration_type):
            out = self._runner(obs)
        if self.device is None:
            return {key: value.detach() for key, value in out.items()}
        return {key: value.detach().to("cpu") for key, value in out.items()}

    async def _call_async(self, obs: dict[NestedKey, torch.Tensor], n: int) -> dict[NestedKey, torch.Tensor]:
        td = TensorDict(obs, batch_size=[n])
        out = await self.policy(td)
        if out is None:
            out = td
        if not isinstance(out, TensorDictBase):
            raise TypeError(
                f"async policy {self.policy!r} returned {type(out).__name__}; it must return a TensorDict "
                "with an 'action' entry (or None after writing into the one it was given)"
            )
        if self._out_keys is None:
            keys = _out_keys(out, set(obs))
            if not any((k if isinstance(k, str) else k[0]) == "action" for k in keys):
                raise KeyError(
                    f"async policy {self.policy!r} did not write an 'action' entry; it wrote {keys}"
                )
            self._out_keys = keys
        return {key: out.get(key) for key in self._out_keys}

    # -- weights ----------------------------------------------------------------------------------
    async def load_weights(self, source: Any) -> None:
        """Copy ``source`` (a module, weights TensorDict or state dict; ``None``: the policy given) into
        the collector's copy, in its thread, between two policy calls."""
        module = self.module
        assert module is not None  # (the collector refuses a policy without weights first)
        source = self.source if source is None else source

        def apply() -> None:
            weights = as_weights(source)
            target = module_weights(module)
            check_compatible(target, weights)
            copy_weights(target, weights)

        await self.in_thread(apply)


class RandomFirst:
    """``init_random_frames`` in a ``MultiAsyncEnvCollector`` worker: wraps what the engine calls on each
    batch of ready envs, the first ``actions`` env actions drawn uniformly from the action space (a call
    that crosses the count gets random actions in its first rows), then the policy's; the policy's other
    outputs are zeros in those frames, which carry the policy version of the moment, as in the other
    collectors' random frames.

    The policy is called at the first call (its outputs say the keys, shapes and dtypes every call has)
    and whenever a call is not all random; draws run in the policy thread (on the loop for an async
    policy, which has none).

    Example:
        >>> from gymnasium.spaces import Discrete
        >>> RandomFirst(None, Discrete(2), actions=8, seed=0).left
        8
    """

    def __init__(
        self, policy: BatchPolicy, action_space: spaces.Space[Any], *, actions: int, seed: int | None
    ) -> None:
        self.policy = policy
        self.left = actions
        self.random = RandomPolicy(action_space, seed=seed)
        self._template: dict[NestedKey, tuple[tuple[int, ...], torch.dtype]] | None = None

    async def __call__(self, obs: dict[NestedKey, torch.Tensor], n: int) -> dict[NestedKey, torch.Tensor]:
        k = min(self.left, n)
        if k == 0:
            return await self.policy(obs, n)
        self.left -= k
        if self._template is None or k < n:
            out = await self.policy(obs, n)
            if self._template is None:
                self._template = {key: (tuple(v.shape[1:]), v.dtype) for key, v in out.items()}
        else:  # all random: no policy call
            out = {
                key: torch.zeros((n, *shape), dtype=dtype) for key, (shape, dtype) in self._template.items()
            }
        if self.policy.is_async:  # no policy thread: a draw is cheap
            draws = self.random.sample_entries((k,))
        else:
            draws = await self.policy.in_thread(lambda: self.random.sample_entries((k,)))
        return {key: _first_rows(value, draws.get(key), k) for key, value in out.items()}


def _first_rows(value: torch.Tensor, draw: torch.Tensor | None, k: int) -> torch.Tensor:
    """``value`` with its first ``k`` rows replaced by ``draw`` (zeros where the random policy drew
    nothing: the policy's other outputs)."""
    shape = (k, *value.shape[1:])
    if draw is None:
        head = torch.zeros(shape, dtype=value.dtype, device=value.device)
    else:
        head = draw.reshape(shape).to(dtype=value.dtype, device=value.device)
    return head if k == value.shape[0] else torch.cat([head, value[k:]])


class ActionCodec:
    """The policy's action entries of a batch -> one action per env, in the form gymnasium takes (a python
    int for ``Discrete``, an array of the space's dtype, a dict/tuple for ``Dict``/``Tuple`` spaces).
    Integer actions outside the space raise ``ValueError`` (never wrapped by a cast)."""

    def __init__(self, space: spaces.Space[Any]) -> None:
        self.space = space
        self.leaves = action_leaf_spaces(space)
        self.bounds = {key: action_bounds(sub) for key, sub in self.leaves.items()}
        self.composite = list(self.leaves) != ["action"]

    def _leaf(self, key: NestedKey, value: torch.Tensor | np.ndarray, n: int) -> np.ndarray:
        sub = self.leaves[key]
        array = value if isinstance(value, np.ndarray) else value.numpy(force=True)
        array = array.reshape((n, *(sub.shape or ())))
        bounds = self.bounds[key]
        if bounds is not None and array.size:
            low, high = bounds
            if np.ndim(low) == 0:  # the ufuncs' reduce: array.min()'s wrappers cost more than the scan
                outside = _MIN(array, None) < low or _MAX(array, None) > high
            else:
                outside = bool((array < low).any() or (array > high).any())
            if outside:
                raise action_outside_space(sub, array, key)
        dtype = np.int64 if isinstance(sub, spaces.Discrete) else sub.dtype
        return array.astype(dtype, copy=False)

    def arrays(self, out: Mapping[NestedKey, Any], n: int) -> dict[NestedKey, np.ndarray]:
        """The action leaves of the policy's outputs (tensors, or arrays) as arrays ``[n, ...]`` (checked
        against the space)."""
        if not self.composite:
            return {"action": self._leaf("action", out["action"], n)}
        missing = [key for key in self.leaves if key not in out]
        if missing:
            raise KeyError(
                f"no action entries {missing}; the action space {self.space} needs {list(self.leaves)}"
            )
        return {key: self._leaf(key, out[key], n) for key in self.leaves}

    def actions(self, arrays: Mapping[NestedKey, np.ndarray], n: int) -> list[Any]:
        """``n`` env actions from :meth:`arrays`' leaves, one per env."""
        if not self.composite:
            array = arrays["action"]
            if isinstance(self.space, spaces.Discrete):
                return array.tolist()
            return list(array)
        return [assemble_action(self.space, functools.partial(_entry, arrays, j)) for j in range(n)]

    def block(self, arrays: Mapping[NestedKey, np.ndarray], start: int, stop: int) -> Any:
        """The actions of rows ``start:stop`` as a vector env takes them: an array ``[stop - start, ...]``
        (a dict or tuple of such arrays for a ``Dict`` or ``Tuple`` space)."""
        if not self.composite:
            return arrays["action"][start:stop]
        return assemble_action(self.space, lambda key, _: arrays[key][start:stop])


def _entry(arrays: Mapping[NestedKey, np.ndarray], j: int, key: NestedKey, space: spaces.Space[Any]) -> Any:
    """Env ``j``'s action entry ``key`` (of ``space``): a python int for a ``Discrete`` one."""
    return int(arrays[key][j]) if isinstance(space, spaces.Discrete) else arrays[key][j]

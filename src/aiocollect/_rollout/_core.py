"""The rollout core: the synchronous hot loop that fills one batch.

Plain Python, no async: it runs in a worker thread (``Collector``) or a worker process (multi-process
collectors). Per step it writes numpy views of preallocated tensors; the TensorDict is built once per
batch. Nothing here knows about event loops.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from math import ceil
from typing import Any, Protocol

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import set_interaction_type

from .._core._options import RolloutOptions, WeightSchedule
from .._core._restart import CountedStop
from .._envs._adapter import ArrayEnv, env_contract
from .._envs._rebuild import EnvRebuilder
from .._envs._spaces import LeafSpec, NestedKey
from .._episodes._groups import EpisodeSeeds, SeededEnv
from .._observe._timesplit import SplitClock
from .._policies._recurrent import Carry, Recurrence, find_recurrence
from .._policies._runners import Runner, as_policy, compile_policy, make_runner, one_input, random_policy_for
from ._batch import end_trajectories, episode_stats, nested_td, stack_into, time_first, trajectory_ids
from ._casts import ActionCaster, lossless_casts
from ._chain import ObsChain
from ._storage import StoragePool, batch_specs

__all__ = ["Rollout", "RolloutResult", "StopSignal", "build_rollout"]

_FLAGS = ("done", "terminated", "truncated")
_ONE_VALUE = frozenset({*_FLAGS, *(("next", f) for f in (*_FLAGS, "reward"))})


@dataclass
class RolloutResult:
    """One batch plus what the collector's statistics need."""

    batch: TensorDict
    #: valid time steps (all of them unless the rollout was stopped early)
    steps: int
    frames: int
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    #: the policy version the batch was collected with
    policy_version: int = 0


@dataclass
class _Steps:
    """What the hot loop keeps per step (references, stacked once at the end of the batch)."""

    out: list[dict[NestedKey, torch.Tensor]] = field(default_factory=list)
    reward: list[Any] = field(default_factory=list)
    terminated: list[Any] = field(default_factory=list)
    truncated: list[Any] = field(default_factory=list)
    #: the episodes' step counts before each step (``options.step_count``), else ``None``
    step_count: list[Any] | None = None
    #: reward and flags went straight into the batch (the fused loop): nothing to stack
    written: bool = False
    out_stacked: bool = False  # ``out`` is one entry, the time dim in place (an EnvPool pool's loop)
    #: steps whose env was restarted after them (``RestartPolicy``): their frames end a trajectory
    cuts: list[int] = field(default_factory=list)


class StopSignal(Protocol):
    """What ``Rollout.collect`` reads to stop early: a job's ``Flag`` (``_rollout/_thread.py``), a
    ``threading.Event``, or a worker's shared stop flag."""

    def is_set(self) -> bool: ...


def _key_tuple(prefix: str, key: NestedKey) -> tuple[str, ...]:
    return (prefix, key) if isinstance(key, str) else (prefix, *key)


class Rollout:
    """Collects batches of ``options.frames_per_batch`` frames from ``env`` with ``policy``.

    ``random_runner`` replaces the policy for random batches (``init_random_frames``). The rollout reads
    ``options`` (its own ``frames_per_batch``, an int, and trajectory ids: see
    :meth:`RolloutOptions.for_member`) and ``schedule.track_policy_version``; batches are moved to
    ``storing_device`` when given (a worker process leaves them in its shared-memory slot).
    """

    def __init__(
        self,
        env: ArrayEnv,
        policy: Runner,
        random_runner: Runner,
        options: RolloutOptions,
        schedule: WeightSchedule | None = None,
        *,
        storing_device: torch.device | None = None,
        recurrence: Recurrence | None = None,
    ) -> None:
        if not isinstance(options.frames_per_batch, int):
            raise TypeError(f"a rollout collects one frames_per_batch, got {options.frames_per_batch!r}")
        # seeded episodes (_episodes/_groups.py)
        if options.group_size is not None or options.on_update == "restart":
            start, stride = options.traj_id_start, options.traj_id_stride
            seeds = EpisodeSeeds(max(env.numel, 1), options.group_size or 1, options.seed, start, stride)
            env = SeededEnv(env, seeds)  # type: ignore[assignment]  # an ArrayEnv with seeded resets
        self.env = env
        self.policy = policy
        self.random_runner = random_runner
        self.options = options
        self.track_policy_version = schedule is not None and schedule.track_policy_version
        self.storing_device = storing_device if storing_device != torch.device("cpu") else None
        self.batch_shape = env.batch_shape
        self.steps_per_batch = ceil(options.frames_per_batch / max(env.numel, 1))
        self.frames_per_batch = self.steps_per_batch * max(env.numel, 1)
        self.policy_version = 0
        self._next_traj = options.traj_id_start
        self._root: dict[NestedKey, np.ndarray] = {}
        self._out_specs: dict[NestedKey, LeafSpec] | None = None
        self._caster: ActionCaster | None = None  # lossless action casts (output_specs)
        self._specs: tuple[list[Any], list[tuple[tuple[int, ...], torch.dtype]]] | None = None
        self._storage = StoragePool()
        # where the time goes (_observe/_timesplit.py): clocks per batch and policy call
        self.clock = SplitClock()
        #: rebuilds the env after a fault (``RestartPolicy``; see :meth:`_run_restarting`), else ``None``
        self.restarts: EnvRebuilder | None = None
        #: the policy's recurrent states (``_policies/_recurrent.py``): those the rollout carries are
        #: observations too
        self.recurrence = recurrence if recurrence is not None else Recurrence()
        self._carry = Carry(self.recurrence, self.batch_shape) if self.recurrence.specs else None
        self._obs_specs = {**env.obs_specs, **self.recurrence.specs}
        self._chainable = ObsChain.applies(self.batch_shape, self._obs_specs)
        self._chain: ObsChain | None = None  # the batch being collected's (_allocate)
        if options.step_count and "step_count" in self._obs_specs:
            raise ValueError(
                "the env has a 'step_count' entry already (a StepCounter): drop max_frames_per_traj and "
                "give the StepCounter max_steps, as TorchRL asks"
            )
        self.reset()

    # -- state ------------------------------------------------------------------------------------
    def _new_ids(self, n: int | np.integer[Any]) -> np.ndarray:
        stride = self.options.traj_id_stride
        start, self._next_traj = self._next_traj, self._next_traj + stride * int(n)
        # one numpy call: ``start + stride * np.arange(n)`` costs ~4 us, and it runs at every episode end
        return np.arange(start, self._next_traj, stride, dtype=np.int64)

    def reset(self, root: dict[NestedKey, np.ndarray] | None = None, *, again: bool = False) -> None:
        """Reset every env (or take ``root``, the observations of a reset done already) and start new
        trajectories; ``again``: the episodes in flight, from their own initial states (seeded episodes)."""
        self._episodes_version = self.policy_version  # on_update="restart": the version episodes began with
        if again:  # (a SeededEnv)
            root = self.env.restart()  # type: ignore[attr-defined]
        self._root = self.env.reset() if root is None else root
        if self._carry is not None:
            self._root = self._carry.start(self._root)
        shape = self.batch_shape
        self._traj_ids = self._new_ids(max(self.env.numel, 1)).reshape(shape)
        self._ep_return = np.zeros(shape, dtype=np.float64)
        self._ep_steps = np.zeros(shape, dtype=np.int64)  # episode lengths for the statistics
        self._ep_length = np.zeros(shape, dtype=np.int64)  # steps for max_frames_per_traj

    @property
    def next_traj_id(self) -> int:
        return self._next_traj

    def state_dict(self) -> dict[str, Any]:
        state = {"next_traj_id": self._next_traj, "policy_version": self.policy_version}
        if isinstance(self.env, SeededEnv):
            state["group_round"] = self.env.next_round
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._next_traj = int(state["next_traj_id"])
        self.policy_version = int(state["policy_version"])
        if isinstance(self.env, SeededEnv):  # groups: every slot starts a round no group has used yet
            self.env.start_at(max(int(state.get("group_round", 0)), self.env.next_round))
            self.reset()
            return
        # the carried trajectories get fresh ids, as after a reset
        self._traj_ids = self._new_ids(max(self.env.numel, 1)).reshape(self.batch_shape)

    def seed_groups(self, seed: int) -> None:
        """``set_seed(seed)``: the groups' reset seeds derive from ``seed`` from the next reset on."""
        if isinstance(self.env, SeededEnv):
            self.env.seeds.rebase(seed, self.env.next_round)

    def output_specs(self) -> dict[NestedKey, LeafSpec]:
        """Keys, shapes and dtypes the policy writes (from one dry call on the current observation)."""
        if self._out_specs is None:
            exp = self.env.action_spec
            try:
                with torch.no_grad(), set_interaction_type(self.options.exploration_type):
                    out = self.policy(self._obs_tensors())
            except KeyError as exc:
                if "'action'" in str(exc):  # the policy wrote no action: say what it should write
                    exc.add_note(
                        f"the action space {self.env.action_space} needs an 'action' entry of shape "
                        f"{exp.shape} per env, dtype {exp.dtype}"
                    )
                raise
            nb = len(self.batch_shape)
            specs = {}
            for key, value in out.items():
                value = value.detach()
                if isinstance(key, tuple) and key[0] == "next":  # a recurrent state: an observation slot
                    self._check_state_output(key, value)
                    continue
                if tuple(value.shape[:nb]) != self.batch_shape:
                    raise ValueError(
                        f"policy output {key!r} has shape {tuple(value.shape)}, which does not start with "
                        f"the env batch shape {self.batch_shape}"
                    )
                specs[key] = LeafSpec(tuple(value.shape[nb:]), value.dtype)
            checked = specs
            if self.options.lossless_action_casts:  # TorchRL's leniency (compat): cast what the env gets
                checked, casts = lossless_casts(self.env, specs)
                if casts:
                    self._caster = ActionCaster(casts, self.batch_shape, self.env.action_from)
            self.env.check_policy_outputs(checked)
            self._out_specs = specs
        return self._out_specs

    def _check_state_output(self, key: tuple[str, ...], value: torch.Tensor) -> None:
        state = key[1] if len(key) == 2 else key[1:]
        spec = self._obs_specs[state]
        shape = (*self.batch_shape, *spec.shape)
        if tuple(value.shape) != shape or value.dtype != spec.dtype:
            raise ValueError(
                f"policy output {key!r} has shape {tuple(value.shape)} and dtype {value.dtype}; the "
                f"recurrent state {state!r} it updates has shape {shape} and dtype {spec.dtype} (its "
                "initial value, batch dims first)"
            )

    def _obs_tensors(self) -> dict[NestedKey, torch.Tensor]:
        return {k: torch.from_numpy(v) for k, v in self._root.items()}

    # -- the hot loop -----------------------------------------------------------------------------
    def _batch_specs(self) -> tuple[list[Any], list[tuple[tuple[int, ...], torch.dtype]]]:
        """The batch's keys and their (shape, dtype), worked out at the first batch."""
        if self._specs is None:
            bt = (*self.batch_shape, self.steps_per_batch)
            shapes: dict[Any, tuple[tuple[int, ...], torch.dtype]] = {}
            for key, spec in self._obs_specs.items():
                shapes[key] = shapes[_key_tuple("next", key)] = ((*bt, *spec.shape), spec.dtype)
            for key, spec in self.env.next_specs.items():  # per-agent rewards
                shapes[_key_tuple("next", key)] = ((*bt, *spec.shape), spec.dtype)
            for key, spec in self.output_specs().items():
                shapes[key] = ((*bt, *spec.shape), spec.dtype)
            for flag in _FLAGS:
                shapes[flag] = shapes[("next", flag)] = ((*bt, 1), torch.bool)
            if self.env.has_reward:
                shapes[("next", "reward")] = ((*bt, 1), torch.float32)
            if self.options.step_count:  # TorchRL's StepCounter keys
                shapes["step_count"] = shapes[("next", "step_count")] = ((*bt, 1), torch.int64)
            shapes[("collector", "traj_ids")] = (bt, torch.int64)
            if self.options.group_size is not None:
                shapes[("collector", "group_id")] = (bt, torch.int64)
            self._specs = batch_specs(shapes, self.frames_per_batch)  # refused if it cannot fit in memory
        return self._specs

    def _allocate(
        self, into: TensorDictBase | None = None, *, named: bool = True, chain: bool = False
    ) -> tuple[TensorDict, dict[Any, np.ndarray]]:
        """The batch's tensors (from ``into``'s, when given) and numpy views to write them through;
        ``named``: the last dim is named ``"time"`` (given to the constructor: cheaper than set after);
        ``chain``: one env's screens stored once per step where they can be (``self._chain``,
        _rollout/_chain.py)."""
        keys, specs = self._batch_specs()
        bt = (*self.batch_shape, self.steps_per_batch)
        at = keys.index(("next", "observation")) if chain and self._chainable and into is None else None
        # one buffer for the batch, reused once the consumer has dropped an earlier batch
        # (_rollout/_storage.py)
        if into is not None:
            taken: list[tuple[torch.Tensor, Any]] = [(into.get(key), None) for key in keys]
        else:
            taken = self._storage.take_arrays(specs if at is None else ObsChain.longer(specs, at))
        self._chain = None if at is None else ObsChain.over(taken, at, keys.index("observation"))
        tensors: dict[Any, torch.Tensor] = {}
        views: dict[Any, np.ndarray] = {}
        for key, (tensor, view) in zip(keys, taken, strict=True):
            tensors[key] = tensor
            if view is None:
                try:
                    view = tensor.numpy()
                except TypeError:  # dtypes numpy lacks (bfloat16): written through torch
                    view = tensor
            if key in _ONE_VALUE:  # the env's flags and reward: one value per frame
                view = view[..., 0]
            views[key] = view
        for flag in _FLAGS:
            views[flag][...] = False
        names: list[str | None] | None = [None] * len(self.batch_shape) + ["time"] if named else None
        return nested_td(tensors, bt, names), views

    def layout(self) -> TensorDict:
        """An empty batch as :meth:`collect` makes it (keys, shapes, dtypes), without collecting."""
        batch, _ = self._allocate(named=False)
        if self.track_policy_version:
            batch.set(("collector", "policy_version"), torch.zeros(batch.batch_size, dtype=torch.int64))
        return batch

    def collect(
        self, *, random: bool = False, stop: StopSignal | None = None, into: TensorDictBase | None = None
    ) -> RolloutResult:
        """Collect one batch. If ``stop`` is set mid-batch, return early with ``steps`` < T.

        ``into``: write the batch into these tensors (a worker's shared-memory slot, laid out as
        :meth:`layout` says) instead of new ones.

        Observations are written into the preallocated batch at the step they arrive (one copy per key
        and frame, and the env may reuse its arrays afterwards); the policy's outputs, rewards and flags
        (small) are kept as references and stacked once at the end, where episode statistics are
        computed too, vectorised. Random batches draw the actions of the whole batch in one call.
        """
        if self.options.reset_at_each_iter:
            self.reset()
        elif self.options.on_update == "restart" and self.policy_version != self._episodes_version:
            self.reset(again=True)  # new weights: the episodes in flight start again (their frames discarded)
        batch, views = self._allocate(into, chain=True)
        runner = self.random_runner if random else self.policy
        block, block_steps = self._random_block(runner)
        hist = _Steps(step_count=[] if self.options.step_count else None)
        mark = self.clock.loop_started()
        with torch.no_grad(), set_interaction_type(self.options.exploration_type), env_contract(self.env):
            if self.restarts is None:
                steps = self._run(self._obs_slots(views), runner, block_steps, hist, stop, views)
            else:
                steps = self._run_restarting(self.restarts, views, runner, block_steps, hist, stop)
        since = self.clock.loop_ended(mark)
        chain, self._chain = self._chain, None  # (a batch the consumer drops leaves its buffer free)
        if chain is not None and (chained := chain.observation()) is not None:
            batch.set("observation", chained)  # the chain held: "observation" is a view of it
        if block is not None:  # a random batch: the actions of every step at once, steps first
            nb = len(self.batch_shape)
            hist.out = [{k: v[:steps].movedim(0, nb) for k, v in block.items()}]
        result = self._finish(batch, views, steps, hist, block is not None or hist.out_stacked, into)
        self.clock.batch_written(since, result.frames)
        return result

    def _run_restarting(
        self,
        restarts: EnvRebuilder,
        views: dict[Any, np.ndarray],
        runner: Runner,
        block_steps: dict[NestedKey, Any] | None,
        hist: _Steps,
        stop: StopSignal | None,
    ) -> int:
        """:meth:`_run` under a restart policy: an env that raises at step ``t`` is rebuilt
        (:meth:`EnvRebuilder.rebuild`) and the batch goes on from step ``t``. The failed step leaves no
        frame, step ``t - 1`` ends its trajectories (``hist.cuts``), the rebuilt env starts new ones. An
        error before the first step, or of the policy, is raised as without a policy."""
        start, restarted = 0, -1  # restarted: the step a rebuilt env started at in this batch
        while True:
            counted = CountedStop(stop)
            try:
                return self._run(self._obs_slots(views), runner, block_steps, hist, counted, views, start)
            except Exception as exc:
                start += counted.calls - 1  # the failed step: `stop` is read first thing at every step
                if counted.calls == 0 or (block_steps is None and len(hist.out) <= start):
                    raise
                for per_step in (hist.out, hist.reward, hist.terminated, hist.truncated, hist.step_count):
                    del (per_step or [])[start:]
                keys, progressed = self.recurrence.env_keys, start != restarted
                self.env, root = restarts.rebuild(self.env, exc, stop, keys, progressed=progressed)
            kept = self._traj_ids, self._ep_return, self._ep_steps
            self.reset(root)
            if start:  # the trajectories end at the cut; _finish numbers the rebuilt env's from there
                hist.cuts.append(start - 1)
                self._traj_ids, self._ep_return, self._ep_steps = kept
            restarted = start

    def _obs_slots(
        self, views: dict[Any, np.ndarray]
    ) -> tuple[list[tuple[NestedKey, np.ndarray]], list[tuple[NestedKey, np.ndarray]]]:
        """The slots of the observations (key, ``"observation"``'s slot) and of the entries of the next
        step (key, ``("next", "observation")``'s slot; per-agent rewards too), as views with time first,
        so that ``slot[t] = array`` is one copy whatever the batch dims."""
        nb = len(self.batch_shape)
        roots = [(key, time_first(views[key], nb)) for key in self._obs_specs]
        nexts = [
            (key, time_first(views[_key_tuple("next", key)], nb))
            for key in (*self._obs_specs, *self.env.next_specs)
        ]
        return roots, nexts

    def _random_block(self, runner: Runner) -> tuple[dict[NestedKey, torch.Tensor] | None, Any]:
        """Random actions for every step at once (steps first), one draw per batch, and their per-step
        entries; ``(None, None)`` for a policy that is called per step."""
        sample_steps = getattr(runner, "sample_steps", None)
        if sample_steps is None:
            return None, None
        block: dict[NestedKey, torch.Tensor] = sample_steps(self.steps_per_batch)
        # a GymEnv takes numpy actions: indexing an array per step is ~10x cheaper than a tensor
        as_numpy = self.env.numpy_actions and all(v.dtype != torch.bfloat16 for v in block.values())
        return block, {k: v.numpy() if as_numpy else v.unbind(0) for k, v in block.items()}

    def _block_actions(self, block_steps: dict[NestedKey, Any]) -> tuple[list[Any], bool]:
        """What ``env.step`` takes at each step of a random batch, picked once per batch, and whether
        the env checked and converted them already (``stepper(converted=True)`` steps them)."""
        if self.env.numpy_actions:
            converted = self.env.action_steps(block_steps)
            if converted is not None:
                return converted, True
        if self.env.one_action:
            return list(block_steps["action"]), False
        action_from = self.env.action_from
        steps = range(self.steps_per_batch)
        return [action_from({k: v[t] for k, v in block_steps.items()}) for t in steps], False

    def _run(
        self,
        obs_slots: tuple[list[tuple[NestedKey, np.ndarray]], list[tuple[NestedKey, np.ndarray]]],
        runner: Runner,
        block_steps: dict[NestedKey, Any] | None,
        hist: _Steps,
        stop: StopSignal | None,
        views: dict[Any, np.ndarray],
        start: int = 0,
    ) -> int:
        """The hot loop: step the env ``steps_per_batch`` times (fewer if ``stop`` is set) from step
        ``start`` (after a restart); returns the steps taken. Everything it reads per step is a local."""
        env = self.env
        caster = self._caster if runner is self.policy else None
        action_from = env.action_from if caster is None else caster.action_from
        batched = bool(self.batch_shape)
        out_hist, rew_hist, term_hist, trunc_hist = hist.out, hist.reward, hist.terminated, hist.truncated
        carry = self._carry
        block_actions, converted = (
            self._block_actions(block_steps) if block_steps is not None else (None, False)
        )
        env_step = env.stepper(converted=converted)
        from_numpy = torch.from_numpy
        root_slots, next_slots = obs_slots
        max_steps = self.options.max_frames_per_traj
        ep_length = self._ep_length
        counts = hist.step_count
        root = self._root
        steps = T = self.steps_per_batch
        if carry is None and max_steps is None and caster is None and (block_actions is None or converted):
            fused = env.fused_gym
            # an EnvPool pool's loop writes its frames at the batch's end: a restart mid-batch steps per step
            if fused is not None and not (self.restarts is not None and fused._pool):
                return self._run_fused(fused, obs_slots, runner, block_actions, hist, stop, views, start)
        runner = self.clock.timed_policy(runner)
        for t in range(start, T):
            if stop is not None and stop.is_set():
                steps = t
                break
            for key, slot in root_slots:
                slot[t] = root[key]
            if block_actions is None:
                out = runner({k: from_numpy(v) for k, v in root.items()})
                out_hist.append(out)
                action = action_from(out)
            else:
                action = block_actions[t]
                if carry is not None:  # a recurrent policy's states: the random step's entries
                    out = {k: v[t] for k, v in block_steps.items()}  # type: ignore[union-attr]
            next_obs, reward, terminated, truncated, next_root = env_step(action)
            forced = None
            if max_steps is not None:
                if counts is not None:
                    counts.append(ep_length)
                ep_length = ep_length + 1
                forced = (ep_length >= max_steps) & ~np.logical_or(terminated, truncated)
                if forced.any():
                    truncated = truncated | forced
                else:
                    forced = None
            if carry is not None:  # recurrent states: ("next", key) from the policy, reset where done
                next_obs, next_root = carry.step(out, next_obs, next_root, terminated | truncated)
            for key, slot in next_slots:
                slot[t] = next_obs[key]
            rew_hist.append(reward)
            term_hist.append(terminated)
            trunc_hist.append(truncated)
            root = next_root
            # trajectory ids are worked out from the done flags once per batch (_finish)
            if max_steps is not None:
                if batched:
                    done = terminated | truncated
                    if np.count_nonzero(done):  # ~3x cheaper than done.any()
                        ep_length = np.where(done, 0, ep_length)
                elif terminated or truncated:
                    ep_length = np.zeros_like(ep_length)
                if forced is not None:
                    root = env.reset(forced) if carry is None else carry.keep(env.reset(forced))
        self._root = root
        self._ep_length = ep_length
        return steps

    def _run_fused(
        self,
        fused: Any,
        obs_slots: tuple[list[tuple[NestedKey, np.ndarray]], list[tuple[NestedKey, np.ndarray]]],
        runner: Runner,
        block_actions: list[Any] | None,
        hist: _Steps,
        stop: StopSignal | None,
        views: dict[Any, np.ndarray],
        start: int,
    ) -> int:
        """:meth:`_run` by ``GymEnv._run_steps``: no call, dict or named tuple per step; reward and flags
        go straight into the batch."""
        nb = len(self.batch_shape)
        reward, terminated, truncated = (
            time_first(views[("next", k)], nb)[start:] for k in ("reward", "terminated", "truncated")
        )
        chain, root = self._chain, self._root["observation"]
        steps, obs = fused._run_steps(
            self.steps_per_batch - start,
            root,
            one_input(runner, "observation"),
            block_actions if block_actions is None or not start else block_actions[start:],
            (
                obs_slots[0][0][1][start:] if chain is None else chain.begin(root, start),
                *(obs_slots[1][0][1][start:], reward, terminated, truncated),
            ),
            hist.out,
            stop,
            self.clock if self.clock.measures else None,
            **({} if chain is None else {"split": chain.split}),
        )
        hist.written, hist.out_stacked = True, getattr(fused, "_pool", False)  # PoolFrames: one entry
        self._root = {"observation": obs}
        return start + int(steps)

    def _finish(
        self,
        batch: TensorDict,
        views: dict[Any, np.ndarray],
        steps: int,
        hist: _Steps,
        out_stacked: bool,
        into: TensorDictBase | None = None,
    ) -> RolloutResult:
        """Stack the per-step lists into the batch (time dim last) and compute episode statistics.

        ``out_stacked``: ``hist.out`` holds one entry with the time dim in place already."""
        nb = len(self.batch_shape)
        lead = (slice(None),) * nb
        valid = (*lead, slice(0, steps))
        traj_v = views[("collector", "traj_ids")]
        reward = views.get(("next", "reward"))
        if reward is None:  # per-agent rewards only: their mean per env, for the statistics
            reward = np.empty((*self.batch_shape, self.steps_per_batch), dtype=np.float32)
        if steps:
            self._write_outputs(views, valid, hist.out, out_stacked)
            if not hist.written:
                stack_into(reward[valid], hist.reward, nb)
                stack_into(views[("next", "terminated")][valid], hist.terminated, nb)
                stack_into(views[("next", "truncated")][valid], hist.truncated, nb)
            end_trajectories(views, hist.cuts, nb, self.env.group_flag_keys)  # restarted envs' last frames
            done_v = views[("next", "done")]
            np.logical_or(
                views[("next", "terminated")][valid],
                views[("next", "truncated")][valid],
                out=done_v[valid],
            )
            if hist.step_count is not None:
                count = views["step_count"][valid][..., 0]
                stack_into(count, hist.step_count, nb)
                np.add(count, 1, out=views[("next", "step_count")][valid][..., 0])
            self._traj_ids, self._next_traj = trajectory_ids(
                traj_v[valid], done_v[valid], self._traj_ids, self._next_traj, self.options.traj_id_stride
            )
            if isinstance(self.env, SeededEnv) and self.options.group_size:  # group ids, as trajectory ids
                self.env.write_groups(views[("collector", "group_id")][valid], done_v[valid])
        if steps < self.steps_per_batch:
            # frames never collected: traj id -1 marks them invalid (their other entries are garbage)
            traj_v[(*lead, slice(steps, None))] = -1
        returns, lengths, self._ep_return, self._ep_steps = episode_stats(
            reward[valid], views[("next", "done")][valid], self._ep_return, self._ep_steps
        )
        if self.options.set_truncated and steps > 0:
            end_trajectories(views, [steps - 1], nb, self.env.group_flag_keys)
        if self.track_policy_version:
            version = into.get(("collector", "policy_version"), None) if into is not None else None
            if version is None:
                version = torch.empty(batch.batch_size, dtype=torch.int64)
            batch.set(("collector", "policy_version"), version.fill_(self.policy_version))
        if self.storing_device is not None:
            batch = batch.to(self.storing_device)
        return RolloutResult(
            batch=batch,
            steps=steps,
            frames=steps * max(self.env.numel, 1),
            episode_returns=returns,
            episode_lengths=lengths,
            policy_version=self.policy_version,
        )

    def _write_outputs(
        self,
        views: dict[Any, np.ndarray],
        valid: tuple[slice, ...],
        out_hist: list[dict[NestedKey, torch.Tensor]],
        out_stacked: bool,
    ) -> None:
        """The policy's outputs of every step, stacked along time into their slots."""
        nb = len(self.batch_shape)
        for key in self.output_specs():
            target = views[key][valid]
            if key not in out_hist[0]:  # a random batch: the policy's other outputs are zeros
                target[...] = 0
                continue
            if out_stacked:
                values = out_hist[0][key]
            else:  # stacked steps first (2-3x cheaper than along the time dim), written time first
                values = torch.stack([o[key] for o in out_hist])
                target = time_first(target, nb) if isinstance(target, np.ndarray) else target.movedim(nb, 0)
            # reshape: a random action of shape () fills a policy's (1,) action slot
            values = values.cpu().reshape(target.shape)
            if isinstance(target, np.ndarray):
                target[...] = values.numpy()
            else:
                target.copy_(values)


def own_policy(policy: Any, random_policy: Any, options: RolloutOptions, *, copy_module: bool) -> Any:
    """The policy a rollout runs: the random policy for ``None``; an ``nn.Module`` (a copy with
    ``copy_module``: no aliasing with the trainer's) on the policy device; compiled if asked for."""
    policy = random_policy if policy is None else as_policy(policy)  # a dict {group: module}: a GroupPolicy
    if isinstance(policy, torch.nn.Module):
        if copy_module:
            try:
                policy = copy.deepcopy(policy)
            except Exception as exc:
                raise TypeError(
                    f"policy {type(policy).__name__} cannot be copied ({exc}); the collector needs its "
                    "own copy of the weights"
                ) from exc
        if options.devices.policy is not None:
            policy = policy.to(options.devices.policy)
    return compile_policy(policy, options.compile_policy)


def build_rollout(
    env: Any,
    policy: Any,
    options: RolloutOptions,
    schedule: WeightSchedule,
    *,
    copy_module: bool,
    storing_device: torch.device | None = None,
    factory: Any = None,
    on_env: Any = None,
) -> tuple[Rollout, Any, Any]:
    """The rollout of ``env`` (checked already) with ``policy`` (see :func:`own_policy`), for ``Collector``
    and the workers alike: returns ``(rollout, the policy it runs, the env's random policy)``.

    With ``options.restart``, ``factory`` rebuilds the env after a fault (``on_env`` is told of the new
    one): see :class:`EnvRebuilder`."""
    array_env = ArrayEnv(env)
    # unseeded: it samples with the collector's torch RNG state (RolloutRNG), like the policy
    random_policy = random_policy_for(array_env)
    policy = own_policy(policy, random_policy, options, copy_module=copy_module)
    recurrence = find_recurrence(
        policy, array_env.obs_specs, env_carries=array_env.torchrl_arrays is not None
    )
    array_env.pass_to_env(recurrence.env_keys)
    runner_kwargs: dict[str, Any] = {
        "batch_shape": array_env.batch_shape,
        "obs_keys": [*array_env.obs_specs, *recurrence.specs],
        "module_keys": array_env.module_obs_keys,
        "device": options.devices.policy,
    }
    rollout = Rollout(
        array_env,
        make_runner(policy, **runner_kwargs, next_keys=recurrence.next_outputs, random=random_policy),
        make_runner(random_policy, **runner_kwargs),
        options,
        schedule,
        storing_device=storing_device,
        recurrence=recurrence,
    )
    if options.restart is not None:
        rollout.restarts = EnvRebuilder(factory, options.restart, seed=options.seed, on_env=on_env)
    return rollout, policy, random_policy

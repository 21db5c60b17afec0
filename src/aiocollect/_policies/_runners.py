"""Policies: ``RandomPolicy``, and the runners the rollout core calls once per step.

A runner takes the current observations as ``{key: Tensor}`` (batch dims first) and returns
``{key: Tensor}`` with ``"action"`` and whatever else the policy writes. Three kinds:

* ``RandomPolicy``: samples from the action space (its own generator if seeded, else torch's RNG);
* a plain ``nn.Module``: called as ``module(*observations)``, its output is the action (no TensorDict);
* a ``TensorDictModule`` or any callable ``td -> td``: called on a TensorDict of the observations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from gymnasium import spaces
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import InteractionType, TensorDictModuleBase

from .._envs._adapter import ArrayEnv
from .._envs._multiagent._spec import masked_choice
from .._envs._spaces import NestedKey, action_specs, sample
from .._envs._torchrl import TorchRLArrays
from ._fast import LazyFastRunner, lazy_fast_runner
from ._group_policy import GroupPolicy, group_runner

__all__ = [
    "RandomPolicy",
    "Runner",
    "TorchRLRandomPolicy",
    "as_policy",
    "compile_policy",
    "make_runner",
    "one_input",
    "parse_exploration_type",
    "random_policy_for",
    "unwrap_compiled",
]

Runner = Callable[[Mapping[NestedKey, torch.Tensor]], dict[NestedKey, torch.Tensor]]

_EXPLORATION = {t.value: t for t in InteractionType}


def parse_exploration_type(value: str | InteractionType) -> InteractionType:
    """``"random"``, ``"deterministic"``, ``"mode"``, ``"mean"``, ``"median"`` or an ``InteractionType``."""
    if isinstance(value, InteractionType):
        return value
    if isinstance(value, str) and value.lower() in _EXPLORATION:
        return _EXPLORATION[value.lower()]
    raise ValueError(
        f"exploration_type={value!r} is not one of {sorted(_EXPLORATION)} or a tensordict.nn.InteractionType"
    )


class RandomPolicy:
    """Uniformly random actions from a gymnasium action space; a callable ``td -> td``.

    Discrete spaces are sampled uniformly, bounded Box dims uniformly in ``[low, high]``, unbounded
    ones from a normal (half-normal past a single bound), as gymnasium does. ``Dict`` and ``Tuple``
    spaces (nested too) are sampled leaf by leaf, written under ``("action", name)`` (a Tuple's
    entries are named ``"0"``, ``"1"``, ...), as a policy writes them.

    Args:
        action_space: the action space of one env.
        seed: with a seed the policy draws from its own ``torch.Generator``; without one it draws from
            torch's global RNG, so ``torch.manual_seed`` and a collector's ``seed`` make it reproducible
            (collectors run the rollout under their own seeded RNG state).

    Example:
        >>> from gymnasium.spaces import Discrete
        >>> from tensordict import TensorDict
        >>> policy = RandomPolicy(Discrete(3), seed=0)
        >>> policy(TensorDict({}, batch_size=[5]))["action"].shape
        torch.Size([5])
    """

    def __init__(self, action_space: spaces.Space[Any], *, seed: int | None = None) -> None:
        action_specs(action_space)  # raises on an unsupported space
        self.action_space = action_space
        self.generator: torch.Generator | None = None
        if seed is not None:
            self.set_seed(seed)

    #: ``sample(batch_shape)`` takes any batch shape (a subclass may draw one env batch at a time)
    samples_any_shape = True
    #: the keys the entries are written at, where not ``action_specs``'s (an env's agent groups)
    rename: dict[NestedKey, NestedKey] | None = None
    #: ``{action key: mask key}``: discrete actions drawn among the legal ones, where the observations
    #: passed to ``__call__`` hold the mask (an env's ``action_mask`` entries, ``[..., n_actions]`` bool)
    masks: dict[NestedKey, NestedKey] | None = None

    def set_seed(self, seed: int) -> None:
        """Draw from an own generator seeded with ``seed`` from now on."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self.generator = torch.Generator().manual_seed(seed)

    def sample_entries(self, batch_shape: tuple[int, ...] = ()) -> dict[NestedKey, torch.Tensor]:
        """The action entries (``{"action": tensor}``, or one nested key per leaf of a Dict/Tuple space)."""
        entries = sample(self.action_space, tuple(batch_shape), self.generator)
        if self.rename:
            return {self.rename.get(k, k): v for k, v in entries.items()}
        return entries

    def sample(self, batch_shape: tuple[int, ...] = ()) -> torch.Tensor | TensorDict:
        """Actions of shape ``batch_shape + action shape``: a tensor, or for a Dict/Tuple space a
        TensorDict of the leaves (what ``td["action"]`` holds after a call)."""
        entries = self.sample_entries(batch_shape)
        if "action" in entries:
            return entries["action"]
        out = TensorDict({}, batch_size=batch_shape)
        for key, value in entries.items():
            out.set(key[1:], value)
        return out

    def sample_legal(
        self, obs: Mapping[NestedKey, torch.Tensor], batch_shape: tuple[int, ...]
    ) -> dict[NestedKey, torch.Tensor]:
        """:meth:`sample_entries`, the masked entries drawn among the actions their mask in ``obs`` allows."""
        entries = self.sample_entries(batch_shape)
        for key, mask_key in (self.masks or {}).items():
            mask = obs.get(mask_key, None)
            if mask is not None and key in entries:
                entries[key] = masked_choice(mask, self.generator).reshape(entries[key].shape)
        return entries

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        for key, value in self.sample_legal(td, tuple(td.batch_size)).items():
            td.set(key, value)
        return td

    def __repr__(self) -> str:
        return f"RandomPolicy({self.action_space!r})"


class TorchRLRandomPolicy(RandomPolicy):
    """Random actions from a torchrl env's ``rand_action`` (its action spec); torch's global RNG.

    Collectors build it for a torchrl env (``init_random_frames``, or no policy). It draws with torch's
    global generator, which a collector with a ``seed`` swaps for its own state around every batch.
    """

    samples_any_shape = False  # the env's rand_action gives one env batch

    def __init__(self, arrays: TorchRLArrays) -> None:  # no gymnasium space to check
        self.arrays = arrays
        self.action_space = arrays.action_torch_spec
        self.generator = None

    def set_seed(self, seed: int) -> None:
        """Nothing to do: the samples come from torch's RNG, which the collectors seed."""

    def sample_entries(self, batch_shape: tuple[int, ...] = ()) -> dict[NestedKey, torch.Tensor]:
        """Every action entry (``"action"``, or ``(group, "action")`` per agent group)."""
        specs = self.arrays.action_specs
        return {k: v.reshape((*batch_shape, *specs[k].shape)) for k, v in self.arrays.rand_action().items()}

    def sample(self, batch_shape: tuple[int, ...] = ()) -> torch.Tensor | TensorDict:
        entries = self.sample_entries(batch_shape)
        if list(entries) == ["action"]:
            return entries["action"]
        return TensorDict(entries, batch_size=batch_shape)

    def __repr__(self) -> str:
        return f"TorchRLRandomPolicy({type(self.arrays.env).__name__})"


def random_policy_for(env: ArrayEnv) -> RandomPolicy:
    """Uniform random actions for ``env`` (``init_random_frames``, or no policy): from its action space,
    or from a torchrl env's ``rand_action``."""
    arrays = env.torchrl_arrays
    if arrays is not None:
        return TorchRLRandomPolicy(arrays)
    policy = RandomPolicy(env.action_space)
    policy.rename = env.action_rename  # agent groups: ("agents", "action"), not ("action", "agents", ...)
    policy.masks = env.action_masks or None  # legal actions only (PettingZoo's action masks)
    return policy


def _is_private(key: NestedKey) -> bool:
    parts = (key,) if isinstance(key, str) else key
    return any(part.startswith("_") for part in parts)


class _RandomRunner:
    def __init__(self, policy: RandomPolicy, batch_shape: tuple[int, ...]) -> None:
        self.policy = policy
        self.batch_shape = batch_shape

    def __call__(self, obs: Mapping[NestedKey, torch.Tensor]) -> dict[NestedKey, torch.Tensor]:
        return self.policy.sample_entries(self.batch_shape)

    def sample_steps(self, steps: int) -> dict[NestedKey, torch.Tensor]:
        """The outputs of ``steps`` calls at once, steps first (one draw per batch instead of per step)."""
        if not self.policy.samples_any_shape:  # one env batch per draw (a torchrl env's rand_action)
            draws = [self({}) for _ in range(steps)]
            return {key: torch.stack([d[key] for d in draws]) for key in draws[0]}
        return _RandomRunner(self.policy, (steps, *self.batch_shape))({})


class _LegalRandomRunner(_RandomRunner):
    """Random actions among the legal ones: drawn at each step from that step's masks (no ``sample_steps``:
    a batch's actions cannot be drawn before its observations)."""

    sample_steps = None  # type: ignore[assignment]

    def __call__(self, obs: Mapping[NestedKey, torch.Tensor]) -> dict[NestedKey, torch.Tensor]:
        return self.policy.sample_legal(obs, self.batch_shape)


class _ModuleRunner:
    """A plain ``nn.Module``: ``action = module(*observations)``."""

    def __init__(self, module: torch.nn.Module, in_keys: list[NestedKey], device: torch.device | None):
        self.module = module
        self.in_keys = in_keys
        self.device = device
        # the common case, one observation and no device move, skips building an argument list
        self._only_key = in_keys[0] if len(in_keys) == 1 and device is None else None

    def __call__(self, obs: Mapping[NestedKey, torch.Tensor]) -> dict[NestedKey, torch.Tensor]:
        if self._only_key is not None:
            out = self.module(obs[self._only_key])
        else:
            if self.device is None:
                args = [obs[k] for k in self.in_keys]
            else:
                args = [obs[k].to(self.device, non_blocking=True) for k in self.in_keys]
            out = self.module(*args)
        if not isinstance(out, torch.Tensor):
            raise self._not_a_tensor(out)
        return {"action": out}

    def one(self, observation: torch.Tensor) -> dict[NestedKey, torch.Tensor]:
        """``self({key: observation})`` for the one observation entry, without the dict."""
        out = self.module(observation)
        if not isinstance(out, torch.Tensor):
            raise self._not_a_tensor(out)
        return {"action": out}

    def _not_a_tensor(self, out: Any) -> TypeError:
        return TypeError(
            f"policy {type(self.module).__name__} returned {type(out).__name__}; a plain nn.Module "
            "policy must return the action tensor. Wrap it in a tensordict.nn.TensorDictModule to "
            "write several outputs"
        )


def one_input(runner: Runner, key: NestedKey) -> Callable[[torch.Tensor], dict[NestedKey, torch.Tensor]]:
    """``runner`` for an env whose only observation entry is ``key``: called on that tensor."""
    if isinstance(runner, _ModuleRunner) and runner._only_key == key:
        return runner.one
    if isinstance(runner, LazyFastRunner):  # the compiled TensorDictModule, once checked
        one = runner.for_one(key)
        if one is not None:
            return one
    return lambda observation: runner({key: observation})


class _TensorDictRunner:
    """A ``TensorDictModule`` or any callable ``td -> td``."""

    def __init__(
        self,
        policy: Callable[[TensorDictBase], Any],
        batch_shape: tuple[int, ...],
        obs_keys: list[NestedKey],
        device: torch.device | None,
        next_keys: Sequence[NestedKey] = (),
    ) -> None:
        self.policy = policy
        self.batch_shape = batch_shape
        self.obs_keys = obs_keys
        self.device = device
        self.next_keys = list(next_keys)  # ("next", state) outputs of a recurrent policy, kept
        self.out_keys: list[NestedKey] | None = None

    def __call__(self, obs: Mapping[NestedKey, torch.Tensor]) -> dict[NestedKey, torch.Tensor]:
        td = TensorDict(dict(obs), batch_size=self.batch_shape)
        if self.device is not None:
            td = td.to(self.device, non_blocking=True)
        out = self.policy(td)
        if out is None:
            out = td
        if not isinstance(out, TensorDictBase):
            raise TypeError(
                f"policy {self.policy!r} returned {type(out).__name__}; a callable policy must return "
                "a TensorDict (td -> td), and an nn.Module one the action tensor"
            )
        if self.out_keys is None:
            obs_keys = set(self.obs_keys)
            self.out_keys = [
                k
                for k in out.keys(include_nested=True, leaves_only=True)
                if k not in obs_keys
                and not _is_private(k)
                and (k if isinstance(k, str) else k[0]) not in ("next", "collector")
            ]
            missing = [k for k in self.next_keys if out.get(k, None) is None]
            if missing:
                raise KeyError(
                    f"policy {self.policy!r} did not write {missing}: a recurrent policy writes the next "
                    "value of each of its states"
                )
            self.out_keys += self.next_keys
            if not any("action" in ((k,) if isinstance(k, str) else k) for k in self.out_keys):
                raise KeyError(
                    f"policy {self.policy!r} did not write an 'action' entry; it wrote {self.out_keys}"
                )
        return {k: out.get(k) for k in self.out_keys}


def make_runner(
    policy: Any,
    *,
    batch_shape: tuple[int, ...],
    obs_keys: list[NestedKey],
    device: torch.device | None,
    module_keys: list[NestedKey] | None = None,
    next_keys: Sequence[NestedKey] = (),
    random: Any = None,
) -> Runner:
    """The per-step callable for ``policy`` (see the module docstring).

    ``module_keys``: the entries a plain ``nn.Module`` is called on (default ``obs_keys``); the env's
    info entries are observations for the batch but not arguments of a plain module. ``next_keys``:
    the ``("next", state)`` outputs of a recurrent policy to return too (``_policies/_recurrent.py``).
    ``random``: the
    env's random policy, for the groups a :class:`GroupPolicy` has no policy for."""
    if isinstance(policy, GroupPolicy):
        return group_runner(
            policy,
            batch_shape=batch_shape,
            obs_keys=obs_keys,
            device=device,
            next_keys=next_keys,
            random=random,
            make_runner=make_runner,
            unwrap_compiled=unwrap_compiled,
        )
    if isinstance(policy, RandomPolicy):
        return (_LegalRandomRunner if policy.masks else _RandomRunner)(policy, batch_shape)
    # a torch.compile'd TensorDictModule is an nn.Module wrapper: it still takes a TensorDict
    if isinstance(unwrap_compiled(policy), TensorDictModuleBase):
        slow = _TensorDictRunner(policy, batch_shape, obs_keys, device, next_keys)
        if unwrap_compiled(policy) is not policy:  # compiled: keeps the TensorDict path
            return slow
        # the key graph compiled into a function of tensors, checked against ``slow`` on the first call
        return lazy_fast_runner(
            policy, slow, obs_keys=obs_keys, batch_shape=batch_shape, device=device, next_keys=next_keys
        )
    if isinstance(policy, torch.nn.Module):
        return _ModuleRunner(policy, obs_keys if module_keys is None else module_keys, device)
    if callable(policy):
        return _TensorDictRunner(policy, batch_shape, obs_keys, device, next_keys)
    if isinstance(policy, Mapping):
        raise TypeError(
            "a policy per group (a dict {group: module}) needs an env with agent groups stepped by "
            "Collector, MultiSyncCollector or MultiAsyncCollector (PettingZooEnv, VmasEnv, a TorchRL "
            "multi-agent env)"
        )
    raise TypeError(
        f"policy must be a TensorDictModule, an nn.Module, a callable td -> td or None, got {policy!r}"
    )


def as_policy(policy: Any) -> Any:
    """A collector's ``policy``: a mapping ``{group: module}`` becomes a :class:`GroupPolicy`; anything
    else is returned as it is."""
    if isinstance(policy, Mapping) and not callable(policy) and not isinstance(policy, TensorDictBase):
        return GroupPolicy(policy)
    return policy


def unwrap_compiled(policy: Any) -> Any:
    """The module under a ``torch.compile`` wrapper (which shares its parameters)."""
    return getattr(policy, "_orig_mod", policy)


def compile_policy(policy: Any, option: bool | Mapping[str, Any]) -> Any:
    """``torch.compile`` the policy when ``option`` is True or a dict of compile kwargs."""
    if option is False or option is None:
        return policy
    kwargs = dict(option) if isinstance(option, Mapping) else {}
    if isinstance(policy, RandomPolicy):
        return policy
    if isinstance(policy, GroupPolicy):  # each group's module compiled in place: its weights keep their names
        for module in policy.values():
            module.compile(**kwargs)
        return policy
    return torch.compile(policy, **kwargs)

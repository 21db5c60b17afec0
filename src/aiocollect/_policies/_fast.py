"""The TensorDictModule fast path: a policy's key graph compiled once into a function of tensors.

:func:`compile_tensordict_policy` turns a ``TensorDictModule`` / ``TensorDictSequential`` /
``ProbabilisticTensorDictModule`` / ``ProbabilisticTensorDictSequential`` tree into a runner that
reads and writes a plain ``{key: Tensor}`` dict, doing what each module's ``forward`` does (same
calls, same sampling code, same keys, same order), with no TensorDict built per step. Anything it
does not fully understand returns ``None``: the caller keeps the TensorDict path.

:func:`lazy_fast_runner` wraps both runners: its first call runs both on the same observations from
the same RNG state and keeps the fast one only if the outputs are bit-identical (``_fast_verify``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import (
    InteractionType,
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModule,
    TensorDictModuleBase,
    TensorDictSequential,
    set_interaction_type,
    skip_existing,
)
from tensordict.nn import probabilistic as _probabilistic
from tensordict.nn.distributions import CompositeDistribution
from tensordict.utils import unravel_key
from torch import Tensor

from .._core._rng import TORCH_RNG_LOCK
from .._envs._spaces import NestedKey
from ._fast_verify import BufferSnapshot, Runner, rng_devices, same_outputs, verify_fast_runner

__all__ = ["LazyFastRunner", "compile_tensordict_policy", "lazy_fast_runner", "verify_fast_runner"]

_Env = dict[NestedKey, Tensor]
_Step = Callable[[_Env], None]

#: private switch for tests: False forces every policy through the TensorDict path
ENABLED = True

_interaction_type: Callable[[], InteractionType | None] = _probabilistic.interaction_type
# tensordict >= 0.15 draws a sample and its log-prob jointly when the distribution can
_joint_sample_and_log_prob = getattr(_probabilistic, "_get_joint_sample_and_log_prob", None)
_RANDOM = InteractionType.RANDOM
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


class _Unsupported(Exception):
    """A construct the compiler does not reproduce exactly: keep the TensorDict path."""


class _Diverged(Exception):
    """At run time, an output the fast path does not handle (not a plain tensor, wrong count)."""


class _Compiler:
    """Walks the module tree in call order, tracking which keys exist (as a nested tree)."""

    def __init__(self, obs_keys: Sequence[NestedKey], td_device: torch.device | None) -> None:
        self.td_device = td_device
        self.tree: dict[str, Any] = {}  # ordered: the TensorDict's key order
        self.reads: set[NestedKey] = set()
        for key in obs_keys:
            self._insert(unravel_key(key))

    # -- keys ---------------------------------------------------------------------------------
    @staticmethod
    def _parts(key: NestedKey) -> tuple[str, ...]:
        return (key,) if isinstance(key, str) else tuple(key)

    def _has_leaf(self, key: NestedKey) -> bool:
        node: Any = self.tree
        for part in self._parts(key):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return node is None

    def _insert(self, key: NestedKey) -> None:
        node = self.tree
        *head, last = self._parts(key)
        for part in head:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):  # a tensor where a sub-tensordict would go
                raise _Unsupported(f"key {key!r} nests under a tensor entry")
        if isinstance(node.get(last), dict):  # a tensor replacing a sub-tensordict
            raise _Unsupported(f"key {key!r} replaces a nested entry")
        node.setdefault(last, None)

    def leaves(self) -> list[NestedKey]:
        out: list[NestedKey] = []

        def walk(node: dict[str, Any], prefix: tuple[str, ...]) -> None:
            for name, child in node.items():
                key = (*prefix, name)
                if child is None:
                    out.append(key[0] if len(key) == 1 else key)
                else:
                    walk(child, key)

        walk(self.tree, ())
        return out

    def read(self, keys: Sequence[NestedKey]) -> list[NestedKey]:
        keys = [unravel_key(k) for k in keys]
        for key in keys:
            if not self._has_leaf(key):  # the TensorDict path would pass None, or a sub-tensordict
                raise _Unsupported(f"in_key {key!r} is not an observation or an earlier output")
        self.reads.update(keys)
        return keys

    def write(self, keys: Sequence[NestedKey]) -> list[NestedKey]:
        keys = [unravel_key(k) for k in keys]
        for key in keys:
            self._insert(key)
        return keys

    # -- modules ------------------------------------------------------------------------------
    def module(self, m: Any) -> list[_Step]:
        if not isinstance(m, TensorDictModuleBase):
            raise _Unsupported(f"{type(m).__name__} is not a TensorDictModuleBase")
        for name in _HOOK_DICTS:
            if getattr(m, name, None):
                raise _Unsupported(f"{type(m).__name__} has hooks")
        kind = _kind(type(m))
        if kind is None:
            raise _Unsupported(f"{type(m).__name__} is not in the allow-list")
        if kind.startswith("torchrl") and getattr(m, "safe", False):
            raise _Unsupported("safe=True: the spec projects the outputs")
        if kind.endswith("prob_module"):
            return [self._prob_module(m, torchrl=kind.startswith("torchrl"))]
        if kind.endswith("td_module"):
            return [self._td_module(m)]
        if kind.endswith("prob_sequence"):
            return self._prob_sequence(m)
        return self._sequence(m)

    def _td_module(self, m: Any) -> _Step:
        if m._kwargs is not None or getattr(m, "_get_kwargs", None) or m.inplace is not True:
            raise _Unsupported("dict in_keys, get_kwargs or inplace != True")
        if m.out_keys != m.out_keys_source or "_" in m.in_keys:
            raise _Unsupported("selected out_keys or '_' in in_keys")
        inner = m.module
        if isinstance(inner, TensorDictModuleBase):
            raise _Unsupported("a TensorDictModule wrapping a TensorDictModule")
        fn = inner if m.method is None else getattr(inner, m.method)
        kwargs = dict(m.method_kwargs)
        in_keys = self.read(m.in_keys)
        out_keys = list(m.out_keys_source)
        n_out = len(out_keys)
        written = iter(self.write([k for k in out_keys if k != "_"]))
        writes = [(i, next(written)) for i, k in enumerate(out_keys) if k != "_"]
        validate = self._validator()
        # one tensor in, one out, no keyword, no device: a link of FastRunner's chain (see _chain_links)
        simple = len(in_keys) == 1 and n_out == 1 and len(writes) == 1 and not kwargs
        link = (fn, in_keys[0], writes[0][1]) if simple and validate is _identity else None

        def step(env: _Env) -> None:
            out = fn(*[env[k] for k in in_keys], **kwargs)
            if type(out) is Tensor:
                outs: tuple[Any, ...] = (out,)
            elif type(out) is tuple:
                outs = out
            else:  # None, a dict, a tensordict, a tensor subclass: the TensorDict path converts it
                raise _Diverged
            if len(outs) != n_out:
                raise _Diverged
            for i, key in writes:
                value = outs[i]
                if type(value) is not Tensor:
                    raise _Diverged
                env[key] = validate(value)

        step.link = link  # type: ignore[attr-defined]
        return step

    def _prob_module(self, m: Any, *, torchrl: bool = False) -> _Step:
        if getattr(m, "_generator", None) is not None or getattr(m, "_generator_key", None) is not None:
            raise _Unsupported("a sampling generator")
        if m.num_samples is not None:
            raise _Unsupported("num_samples")
        dist_class = m.distribution_class
        if isinstance(dist_class, type) and issubclass(dist_class, CompositeDistribution):
            raise _Unsupported("CompositeDistribution")
        if "_" in m.dist_sample_keys:
            raise _Unsupported("the default '_' out_key")
        names = [k[-1] if isinstance(k, tuple) else k for k in m.dist_keys]
        pairs = list(zip(names, self.read(m.in_keys), strict=True))
        dist_kwargs = m.distribution_kwargs
        return_log_prob = bool(m.return_log_prob)
        lp_key = None
        if return_log_prob:
            try:
                lp_key = unravel_key(m.log_prob_key)
            except Exception as exc:  # several log-prob keys, or an aggregation mode changed
                raise _Unsupported("log_prob_key") from exc
        sample_keys = self.write(list(m.dist_sample_keys))
        if lp_key is not None:
            self.write([lp_key])
        n_samples = len(sample_keys)
        validate = self._validator()
        dist_sample = m._dist_sample
        joint = _joint_sample_and_log_prob if return_log_prob else None
        if torchrl and return_log_prob:  # SafeProbabilisticModule.forward draws both with torchrl's helper
            joint = _torchrl_joint()
        empty = torch.Size(())

        def step(env: _Env) -> None:
            dist: Any = dist_class(**{name: env[k] for name, k in pairs}, **dist_kwargs)
            itype = _interaction_type()
            sample_and_lp = None
            if joint is not None and (itype or m.default_interaction_type) is _RANDOM:
                sample_and_lp = joint(dist)
            log_prob = None
            if sample_and_lp is not None:
                out, log_prob = sample_and_lp(empty)
            else:
                out = dist_sample(dist, interaction_type=itype, generator=None)
            if type(out) is Tensor:
                outs: tuple[Any, ...] = (out,)
            elif type(out) is tuple:
                outs = out
            else:
                raise _Diverged
            if len(outs) != n_samples:
                raise _Diverged
            for key, value in zip(sample_keys, outs, strict=True):
                if type(value) is not Tensor:
                    raise _Diverged
                env[key] = validate(value)
            if lp_key is not None:
                if log_prob is None:
                    log_prob = dist.log_prob(*outs)
                if type(log_prob) is not Tensor:
                    raise _Diverged
                env[lp_key] = validate(log_prob)

        return step

    def _check_sequence(self, m: Any) -> list[Any]:
        if m.partial_tolerant or m._select_before_return or m.inplace not in (None, True):
            raise _Unsupported("partial_tolerant, selected_out_keys or inplace")
        return list(m._module_iter())

    def _sequence(self, m: Any) -> list[_Step]:
        steps: list[_Step] = []
        for child in self._check_sequence(m):
            steps += self.module(child)
        return steps

    def _prob_sequence(self, m: Any) -> list[_Step]:
        children = self._check_sequence(m)
        if not getattr(m, "_requires_sample", True):
            raise _Unsupported("a sequence whose prefix writes the sample")
        if m.return_composite:
            steps: list[_Step] = []
            for child in children:
                steps += self.module(child)
            return steps
        # get_dist_params: the modules before the last run under the interaction type of the last
        # module that has a default one, when none is set
        default = None
        for child in reversed(children):
            if hasattr(child, "default_interaction_type"):
                if not isinstance(child, ProbabilisticTensorDictModule):
                    raise _Unsupported("a nested sequence sets the default interaction type")
                default = child.default_interaction_type
                break
        if default is None:
            raise _Unsupported("no default interaction type")
        det: list[_Step] = []
        for child in children[:-1]:
            det += self.module(child)
        last = children[-1]
        if isinstance(last, ProbabilisticTensorDictSequential):
            raise _Unsupported("a nested probabilistic sequence as the last module")
        tail = self.module(last)

        def det_part(env: _Env) -> None:
            if _interaction_type() is None:
                with set_interaction_type(default):
                    for step in det:
                        step(env)
            else:
                for step in det:
                    step(env)

        return [det_part, *tail] if det else tail

    def _validator(self) -> Callable[[Tensor], Tensor]:
        """What ``TensorDict.set`` does to a tensor: move it to the tensordict's device, if it has one."""
        device = self.td_device
        if device is None:
            return _identity

        def to_device(value: Tensor) -> Tensor:
            return value if value.device == device else value.to(device)

        return to_device


_TENSORDICT_KINDS = {
    TensorDictModule: "td_module",
    ProbabilisticTensorDictModule: "prob_module",
    TensorDictSequential: "sequence",
    ProbabilisticTensorDictSequential: "prob_sequence",
}
# torchrl classes whose forward is tensordict's (or, for SafeProbabilisticModule, reproduced here):
# checked against torchrl 0.14's source; a later torchrl that changes them fails the first-call check
_TORCHRL_KINDS = {
    "torchrl.modules.tensordict_module.common.SafeModule": "torchrl_td_module",
    "torchrl.modules.tensordict_module.actors.Actor": "torchrl_td_module",
    "torchrl.modules.tensordict_module.sequence.SafeSequential": "torchrl_sequence",
    "torchrl.modules.tensordict_module.probabilistic.SafeProbabilisticModule": "torchrl_prob_module",
    "torchrl.modules.tensordict_module.probabilistic.SafeProbabilisticTensorDictSequential": (
        "torchrl_prob_sequence"
    ),
    "torchrl.modules.tensordict_module.actors.ProbabilisticActor": "torchrl_prob_sequence",
}


def _kind(cls: type) -> str | None:
    kind = _TENSORDICT_KINDS.get(cls)
    if kind is None:
        kind = _TORCHRL_KINDS.get(f"{cls.__module__}.{cls.__qualname__}")
    return kind


def _torchrl_joint() -> Callable[[Any], Callable[[torch.Size], Any]]:
    """torchrl's ``SafeProbabilisticModule`` sampling under RANDOM with ``return_log_prob``."""
    try:
        from torchrl.modules.distributions.utils import sample_and_log_prob
    except ImportError as exc:
        raise _Unsupported("this torchrl has no sample_and_log_prob") from exc

    def joint(dist: Any) -> Callable[[torch.Size], Any]:
        return lambda shape: sample_and_log_prob(dist, shape, reparameterize=dist.has_rsample)

    return joint


def _identity(value: Tensor) -> Tensor:
    return value


class FastRunner:
    """The compiled policy: observations in, the policy's outputs out, as plain dicts of tensors."""

    def __init__(
        self,
        policy: TensorDictModuleBase,
        steps: list[_Step],
        obs_pairs: list[tuple[NestedKey, NestedKey]],
        out_keys: list[NestedKey],
        device: torch.device | None,
    ) -> None:
        self.policy = policy
        self.out_keys = out_keys
        self._steps = steps
        self._obs_pairs = obs_pairs
        self._device = device

    def __call__(self, obs: Mapping[NestedKey, Tensor]) -> dict[NestedKey, Tensor]:
        device = self._device
        if device is None:
            env = {key: obs[src] for src, key in self._obs_pairs}
        else:
            env = {key: obs[src].to(device, non_blocking=True) for src, key in self._obs_pairs}
        for step in self._steps:
            step(env)
        return {key: env[key] for key in self.out_keys}

    def one(self, key: NestedKey) -> Callable[[Tensor], dict[NestedKey, Tensor]]:
        """``self({key: observation})`` for a policy that reads only the observation ``key``, as a
        function of that tensor. A chain of single-input, single-output ``TensorDictModule``s, each
        reading the one before's output (the first the observation), is called without the dict of
        keys: its outputs are the chain's out_keys in order (TensorDict paths' key order)."""
        links = self._chain_links(key)
        if links is None:
            run = self.__call__
            return lambda observation: run({key: observation})
        if len(links) == 1:
            ((f1, k1),) = links

            def chain1(x: Tensor) -> dict[NestedKey, Tensor]:
                a = f1(x)
                return {k1: a if type(a) is Tensor else _only_tensor(a)}

            return chain1
        if len(links) == 2:  # a network, then a sampler: the common TensorDictSequential
            (f1, k1), (f2, k2) = links

            def chain2(x: Tensor) -> dict[NestedKey, Tensor]:
                a = f1(x)
                if type(a) is not Tensor:
                    a = _only_tensor(a)
                b = f2(a)
                return {k1: a, k2: b if type(b) is Tensor else _only_tensor(b)}

            return chain2

        def chain(x: Tensor) -> dict[NestedKey, Tensor]:
            out: dict[NestedKey, Tensor] = {}
            for fn, out_key in links:
                x = fn(x)
                if type(x) is not Tensor:
                    x = _only_tensor(x)
                out[out_key] = x
            return out

        return chain

    def _chain_links(self, key: NestedKey) -> list[tuple[Callable[..., Any], NestedKey]] | None:
        """``(fn, out_key)`` per module where :meth:`one` can call the modules as a chain, else None."""
        key = unravel_key(key)
        if self._device is not None or self._obs_pairs != [(key, key)]:
            return None
        links = [getattr(step, "link", None) for step in self._steps]
        previous = key
        for link in links:
            if link is None or link[1] != previous:
                return None
            previous = link[2]
        outs = [link[2] for link in links]  # type: ignore[index]
        # each output new (no overwrite), and the runner returns exactly them, in this order
        if len(set(outs)) != len(outs) or key in outs or outs != self.out_keys:
            return None
        return [(link[0], link[2]) for link in links]  # type: ignore[index]


def _only_tensor(out: Any) -> Tensor:
    """A module's output where a link of a chain wants one tensor: a 1-tuple of a tensor is taken (as
    the step does); anything else (None, a dict, a tensor subclass) is the TensorDict path's to convert."""
    if type(out) is tuple and len(out) == 1 and type(out[0]) is Tensor:
        return out[0]
    raise _Diverged


def compile_tensordict_policy(
    policy: Any,
    obs_keys: Sequence[NestedKey],
    batch_shape: tuple[int, ...],
    device: torch.device | None,
    next_keys: Sequence[NestedKey] = (),
) -> FastRunner | None:
    """A runner doing what ``policy(TensorDict(obs))`` does without the TensorDict, or ``None``.

    Supports ``TensorDictModule``, ``TensorDictSequential``, ``ProbabilisticTensorDictModule`` and
    ``ProbabilisticTensorDictSequential`` (exact classes, nested freely) with default options; any
    other construct returns ``None``. ``next_keys``: ``("next", state)`` outputs returned too (the
    recurrent states of the policy).
    """
    return _compile(policy, obs_keys, batch_shape, device, next_keys)[0]


def unsupported_reason(
    policy: Any, obs_keys: Sequence[NestedKey], batch_shape: tuple[int, ...], device: torch.device | None
) -> str | None:
    """Why :func:`compile_tensordict_policy` returns ``None`` for ``policy`` (``None`` if it compiles)."""
    return _compile(policy, obs_keys, batch_shape, device)[1]


def _compile(
    policy: Any,
    obs_keys: Sequence[NestedKey],
    batch_shape: tuple[int, ...],
    device: torch.device | None,
    next_keys: Sequence[NestedKey] = (),
) -> tuple[FastRunner | None, str | None]:
    if any(getattr(torch.nn.modules.module, name, None) for name in _GLOBAL_HOOKS):
        return None, "global module hooks"
    td_device = None
    if device is not None:  # the device the TensorDict path's tensordict gets
        td_device = TensorDict({}, batch_size=batch_shape).to(device).device
    compiler = _Compiler(obs_keys, td_device)
    try:
        steps = compiler.module(policy)
    except _Unsupported as exc:
        return None, str(exc)
    obs_set = set(obs_keys)
    out_keys = [
        k
        for k in compiler.leaves()
        if k not in obs_set
        and not _is_private(k)
        and (k if isinstance(k, str) else k[0]) not in ("next", "collector")
    ]
    if not any(
        "action" in ((k,) if isinstance(k, str) else k) for k in out_keys
    ):  # the TensorDict path raises
        return None, "no 'action' output"
    leaves = set(compiler.leaves())
    next_keys = [unravel_key(k) for k in next_keys]
    if any(k not in leaves for k in next_keys):  # the TensorDict path raises the error
        return None, "a recurrent state's ('next', ...) output is not written"
    out_keys += next_keys
    # only the observations the policy reads travel (and move to the device)
    needed = compiler.reads
    pairs = [(k, unravel_key(k)) for k in obs_keys]
    pairs = [(src, key) for src, key in pairs if key in needed]
    return FastRunner(policy, steps, pairs, out_keys, td_device), None


def _is_private(key: NestedKey) -> bool:
    parts = (key,) if isinstance(key, str) else key
    return any(part.startswith("_") for part in parts)


class LazyFastRunner:
    """Runs ``slow`` on the first call and checks ``fast`` against it; then the one that matched.

    The first call runs ``fast`` from a forked copy of the RNG state (buffers restored after it),
    then ``slow`` from the real state, and returns the slow output: the RNG advances as on the
    TensorDict path. ``uses_fast_path`` tells which runner later calls take.
    """

    def __init__(self, fast: FastRunner, slow: Runner) -> None:
        self.fast = fast
        self.slow = slow
        self.uses_fast_path: bool | None = None  # None: not decided yet

    def __call__(self, obs: Mapping[NestedKey, Tensor]) -> dict[NestedKey, Tensor]:
        if self.uses_fast_path and not skip_existing():
            try:
                return self.fast(obs)
            except _Diverged:  # an output of a kind the first call did not show: TensorDict path
                self.uses_fast_path = False
        if self.uses_fast_path is None:
            return self._first_call(obs)
        return self.slow(obs)

    def for_one(self, key: NestedKey) -> Callable[[Tensor], dict[NestedKey, Tensor]] | None:
        """Once the fast path is chosen, ``self({key: observation})`` as a function of the tensor,
        calling :meth:`FastRunner.one` directly (the runner's checks per call, ``skip_existing()`` and
        a diverging output, are kept); ``None`` before the first call decided, or if it chose ``slow``."""
        if self.uses_fast_path is not True:
            return None
        fast_one = self.fast.one(key)

        def call(observation: Tensor) -> dict[NestedKey, Tensor]:
            if self.uses_fast_path and not skip_existing():
                try:
                    return fast_one(observation)
                except _Diverged:  # as __call__: the TensorDict path from now on
                    self.uses_fast_path = False
            return self({key: observation})

        return call

    def _first_call(self, obs: Mapping[NestedKey, Tensor]) -> dict[NestedKey, Tensor]:
        policy = self.fast.policy
        fast_out = None
        if not skip_existing():
            snapshot = BufferSnapshot(policy)
            with TORCH_RNG_LOCK.shared(), torch.random.fork_rng(devices=rng_devices()):
                try:
                    fast_out = self.fast(obs)
                except Exception:
                    fast_out = None
            snapshot.restore()
        slow_out = self.slow(obs)
        self.uses_fast_path = fast_out is not None and same_outputs(fast_out, slow_out)
        return slow_out

    def __getattr__(self, name: str) -> Any:  # the slow runner's attributes (policy, out_keys...)
        if name in ("fast", "slow"):
            raise AttributeError(name)
        return getattr(self.slow, name)


def lazy_fast_runner(
    policy: Any,
    slow: Runner,
    *,
    obs_keys: Sequence[NestedKey],
    batch_shape: tuple[int, ...],
    device: torch.device | None,
    next_keys: Sequence[NestedKey] = (),
) -> Runner:
    """``slow`` wrapped with the fast path when ``policy`` compiles, else ``slow`` itself."""
    if not ENABLED:
        return slow
    fast = compile_tensordict_policy(policy, obs_keys, batch_shape, device, next_keys)
    if fast is None:
        return slow
    return LazyFastRunner(fast, slow)

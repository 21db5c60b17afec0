"""A policy per agent group: ``policy={"adversary": actor_a, "agent": actor_b}`` (RLlib's policy mapping,
TorchRL's one module per group).

A mapping given as a collector's ``policy`` becomes a :class:`GroupPolicy`, an ``nn.ModuleDict``, so that
copies, devices, weight updates (``update_weights(mapping)``, ``update_weights()``), versions and
checkpoints work on it as on one policy: its weights are ``{group: module weights}``.

At each step a plain ``nn.Module`` member is called on its group's observation (``(group, "observation")``,
or its leaves in order for a ``Dict`` observation) and its output is ``(group, "action")``; a
``TensorDictModule`` member runs as it is (it reads and writes the keys it names). Groups without a member
act randomly, among their legal actions where the env has action masks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict.nn import TensorDictModuleBase

from .._envs._spaces import NestedKey

__all__ = ["GroupPolicy", "GroupRunner", "group_runner"]


class GroupPolicy(torch.nn.ModuleDict):
    """One policy per agent group, ``{group: nn.Module}``; a collector's ``policy`` may be given as a plain
    dict, which becomes one of these.

    Example:
        >>> from torch import nn
        >>> policy = GroupPolicy({"agent": nn.Linear(18, 5)})
        >>> sorted(dict(policy.named_parameters()))
        ['agent.bias', 'agent.weight']
    """

    def __init__(self, policies: Mapping[str, torch.nn.Module]) -> None:
        if not isinstance(policies, Mapping) or not policies:
            raise TypeError(f"a policy per group is a non-empty dict {{group: nn.Module}}, got {policies!r}")
        for group, module in policies.items():
            if not isinstance(group, str) or not group or "." in group:
                raise TypeError(f"policy: group names are non-empty strs without '.', got {group!r}")
            if not isinstance(module, torch.nn.Module):
                raise TypeError(
                    f"policy[{group!r}] is {type(module).__name__}: a group's policy is an nn.Module (a "
                    "plain one is called on the group's observation; wrap a function in a "
                    "tensordict.nn.TensorDictModule)"
                )
        super().__init__()
        for group, module in policies.items():
            if hasattr(self, group):
                raise ValueError(
                    f"policy: the group name {group!r} is an attribute of torch.nn.ModuleDict, which holds "
                    "the groups' modules; name the env's groups otherwise (group_map={...})"
                )
            self[group] = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "a GroupPolicy is not called as a whole: the collectors call each group's policy on its group's "
            "entries (see docs/multiagent.md)"
        )


def group_runner(
    policy: GroupPolicy,
    *,
    batch_shape: tuple[int, ...],
    obs_keys: list[NestedKey],
    device: torch.device | None,
    next_keys: Sequence[NestedKey] = (),
    random: Any = None,
    make_runner: Callable[..., Any],
    unwrap_compiled: Callable[[Any], Any],
) -> GroupRunner:
    """The per-step runner (``_policies/_runners.py``'s ``make_runner`` builds it, and hands itself and
    ``unwrap_compiled`` in, so that this module needs nothing of it): each member's runner, and the env's
    random policy for the groups without one."""
    if random is None:
        raise TypeError(
            "a policy per group needs an env with agent groups stepped by Collector, MultiSyncCollector "
            "or MultiAsyncCollector (PettingZooEnv, VmasEnv, a TorchRL multi-agent env)"
        )
    groups = {k[0] for k in obs_keys if isinstance(k, tuple)}
    unknown = sorted(set(policy) - groups)
    if unknown:
        raise KeyError(
            f"policy has groups {unknown} that the env does not have; its groups are {sorted(groups)}"
        )
    members: dict[str, tuple[Any, NestedKey | None]] = {}
    for group, module in policy.items():
        leaves: list[NestedKey] = [
            k for k in obs_keys if isinstance(k, tuple) and k[:2] == (group, "observation")
        ]
        plain = not isinstance(unwrap_compiled(module), TensorDictModuleBase)
        if plain and not leaves:
            raise KeyError(
                f"policy[{group!r}] is a plain nn.Module: the env has no {(group, 'observation')!r}"
            )
        own = [k for k in next_keys if k in getattr(module, "out_keys", ())]
        run = make_runner(
            module,
            batch_shape=batch_shape,
            obs_keys=obs_keys,
            device=device,
            module_keys=leaves,
            next_keys=own,
        )
        members[group] = (run, (group, "action") if plain else None)
    return GroupRunner(members, make_runner(random, batch_shape=batch_shape, obs_keys=obs_keys, device=None))


class GroupRunner:
    """Calls each group's runner; the groups without one get the env's random actions (legal ones)."""

    def __init__(self, members: dict[str, tuple[Any, NestedKey | None]], random: Any) -> None:
        self.members = members
        self.random = random
        self._random_keys: list[NestedKey] | None = None

    def __call__(self, obs: Mapping[NestedKey, torch.Tensor]) -> dict[NestedKey, torch.Tensor]:
        out: dict[NestedKey, torch.Tensor] = {}
        for run, action_key in self.members.values():
            result = run(obs)
            if action_key is not None:  # a plain module: its output is its group's action
                out[action_key] = result["action"]
            else:
                out.update(result)
        keys = self._random_keys
        if keys is None or keys:
            drawn = self.random(obs)
            if keys is None:  # the first call: which groups have no policy
                keys = self._random_keys = self._check(drawn)
            for key in keys:
                out[key] = drawn[key]
        return out

    def _check(self, drawn: Mapping[NestedKey, torch.Tensor]) -> list[NestedKey]:
        """The action keys of the groups without a policy (raise for a group the env does not have)."""
        groups = {k[0] for k in drawn if isinstance(k, tuple) and len(k) == 2}
        unknown = sorted(set(self.members) - groups)
        if unknown:
            raise KeyError(
                f"policy has groups {unknown} that the env does not have; its groups are {sorted(groups)}"
            )
        return [k for k in drawn if isinstance(k, tuple) and k[0] not in self.members]

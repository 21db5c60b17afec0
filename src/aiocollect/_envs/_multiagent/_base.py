"""What ``PettingZooEnv`` and ``VmasEnv`` share: the env protocol (TensorDicts) over their array interface,
which the rollout steps directly (``ArrayEnv``: numpy arrays in and out, no TensorDict per step).

An env of this kind has agent groups (:class:`~._spec.GroupLayout`) and keeps two preallocated frames of
arrays, ``[*batch, n_agents, ...]`` per key: the entries of the last step (``next``) and, where a sub-env
was reset in that step, the observations to act on (``root``). Arrays handed out are valid until the
next step or reset (the rollout copies them into its batch at once); the TensorDict methods copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gymnasium import spaces
from tensordict import TensorDict

from .._gym import ArrayStep
from .._spaces import LeafSpec, NestedKey
from ._spec import FLAGS, GroupLayout, stack_space

__all__ = ["GroupedEnv", "Frame"]


class Frame:
    """Preallocated arrays ``[copies, *spec.shape]`` for every key of ``specs``."""

    def __init__(self, specs: dict[NestedKey, LeafSpec], copies: int) -> None:
        self.arrays = {k: np.zeros((copies, *s.shape), dtype=s.numpy_dtype) for k, s in specs.items()}

    def view(self, batched: bool) -> dict[NestedKey, np.ndarray]:
        """The arrays as the rollout takes them: ``[copies, ...]``, or one env's ``[...]``."""
        return self.arrays if batched else {k: v[0] for k, v in self.arrays.items()}


class GroupedEnv:
    """The common part of the multi-agent envs (a private base: the public classes are its only kinds).

    Subclasses set ``groups`` (``{name: GroupLayout}``), ``_batch_shape``, optional ``_state_spec``
    (a global state, ``"state"``) and implement ``_reset_arrays(mask)`` / ``_step_arrays(action)``.
    """

    groups: dict[str, GroupLayout]
    _batch_shape: tuple[int, ...]
    _state_spec: LeafSpec | None = None
    #: no top-level reward: the groups' rewards, ``("next", group, "reward")`` (their mean is the env's in
    #: the episode statistics)
    has_reward = False
    has_truncated = True

    if TYPE_CHECKING:  # what the subclasses implement

        def _reset_arrays(self, mask: np.ndarray | None = None) -> dict[NestedKey, np.ndarray]: ...

        def _step_arrays(self, action: Mapping[NestedKey, Any]) -> ArrayStep: ...

        def close(self) -> None: ...

    def _init_specs(self) -> None:
        """The batch specs of the groups (call once ``groups`` is set)."""
        self.obs_specs: dict[NestedKey, LeafSpec] = {}
        for layout in self.groups.values():
            self.obs_specs.update(layout.specs())
        if self._state_spec is not None:
            self.obs_specs["state"] = self._state_spec
        self.action_specs: dict[NestedKey, LeafSpec] = {
            (g, "action"): layout.action_spec() for g, layout in self.groups.items()
        }
        self.next_specs: dict[NestedKey, LeafSpec] = {
            (g, "reward"): LeafSpec((layout.n, 1), torch.float32) for g, layout in self.groups.items()
        }
        self.group_flag_keys: list[NestedKey] = [
            (g, f) for g, lay in self.groups.items() if lay.flags for f in FLAGS
        ]
        #: the observation entries a plain ``nn.Module`` policy is called on: the groups' observations
        self.module_obs_keys = [k for lay in self.groups.values() for k in lay.obs_keys()]
        #: ``{(group, "action"): (group, "action_mask")}``: random actions are drawn among the legal ones
        self.action_masks = {
            (g, "action"): (g, "action_mask") for g, lay in self.groups.items() if lay.action_mask is not None
        }
        self._action_space = spaces.Dict(
            {g: spaces.Dict({"action": lay.action_space()}) for g, lay in self.groups.items()}
        )
        self._observation_space = spaces.Dict(
            {
                g: spaces.Dict({"observation": stack_space(lay.obs_space, lay.n)})
                for g, lay in self.groups.items()
            }
        )
        self.group_map = {g: list(lay.agents) for g, lay in self.groups.items()}

    # -- the env protocol --------------------------------------------------------------------------
    @property
    def batch_size(self) -> torch.Size:
        return torch.Size(self._batch_shape)

    @property
    def action_space(self) -> spaces.Dict:
        """``Dict({group: Dict({"action": ...})})``: each group's actions, agent dim first."""
        return self._action_space

    @property
    def observation_space(self) -> spaces.Dict:
        """``Dict({group: Dict({"observation": ...})})`` (the other entries: ``obs_specs``)."""
        return self._observation_space

    def reset(self, td: TensorDict | None = None) -> TensorDict:
        reset = None if td is None else td.get("_reset", None)
        mask = None if reset is None else reset.reshape(self._batch_shape).cpu().numpy().astype(bool)
        return self._td(self._reset_arrays(mask))

    def step(self, td: TensorDict) -> TensorDict:
        action: dict[NestedKey, Any] = {key: td.get(key) for key in self.action_specs}
        result = self._step_arrays(action)
        bs = self.batch_size
        nxt = self._td(result.next_obs)
        terminated = torch.as_tensor(np.asarray(result.terminated)).reshape(*bs, 1)
        truncated = torch.as_tensor(np.asarray(result.truncated)).reshape(*bs, 1)
        for key in self.next_specs:
            nxt.set(key, torch.tensor(result.next_obs[key]))
        nxt.set("done", terminated | truncated)
        nxt.set("terminated", terminated)
        nxt.set("truncated", truncated)
        return TensorDict({"next": nxt}, batch_size=bs)

    def _td(self, arrays: dict[NestedKey, np.ndarray]) -> TensorDict:
        td = TensorDict({}, batch_size=self.batch_size)
        for key in self.obs_specs:
            td.set(key, torch.tensor(arrays[key]))  # a copy: the arrays are the env's buffers
        return td

    # -- for the subclasses -------------------------------------------------------------------------
    def _frames(self, copies: int) -> tuple[Frame, Frame]:
        """The two preallocated frames: ``next`` (the step's entries) and ``root`` (resets written in)."""
        specs: dict[NestedKey, LeafSpec] = {**self.obs_specs, **self.next_specs}
        return Frame(specs, copies), Frame(self.obs_specs, copies)

    def _result(
        self, nxt: Frame, root: Frame | None, terminated: np.ndarray, truncated: np.ndarray
    ) -> ArrayStep:
        """The :class:`ArrayStep` of a step: ``root`` holds the reset sub-envs' rows (``None``: no reset)."""
        batched = bool(self._batch_shape)
        next_obs = nxt.view(batched)
        root_obs = next_obs if root is None else root.view(batched)
        reward = np.concatenate(
            [next_obs[k].reshape(*self._batch_shape, -1) for k in self.next_specs], axis=-1
        ).mean(-1, dtype=np.float32)
        if not batched:
            return ArrayStep(next_obs, float(reward), bool(terminated[0]), bool(truncated[0]), root_obs)
        return ArrayStep(next_obs, reward, terminated, truncated, root_obs)

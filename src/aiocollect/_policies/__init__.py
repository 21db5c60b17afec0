"""Policies: the runners the rollout calls, the TensorDictModule fast path, recurrent state, weights as
TensorDicts."""

__all__: list[str] = []

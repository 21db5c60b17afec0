"""The TensorDictModule fast path (``_fast_policy``): bit-identical to the TensorDict path, or not used."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import (
    InteractionType,
    NormalParamExtractor,
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModule,
    TensorDictSequential,
    set_interaction_type,
    set_skip_existing,
)
from tensordict.nn.distributions import CompositeDistribution, TruncatedNormal
from torch import distributions as D
from torch import nn

from aiocollect import Collector, GymEnv
from aiocollect._policies import _fast as _fast_policy
from aiocollect._policies._fast import (
    LazyFastRunner,
    compile_tensordict_policy,
    same_outputs,
    unsupported_reason,
    verify_fast_runner,
)
from aiocollect._policies._runners import _TensorDictRunner, make_runner, one_input

OBS = ["observation"]


def mlp(n_in: int, n_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(n_in, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, n_out))


class TwoHeads(nn.Module):
    """One module, two outputs (two out_keys)."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Linear(8, 3)
        self.value = nn.Linear(8, 1)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.logits(hidden), self.value(hidden)


class TanhNormalLike(D.Normal):
    """A distribution with a joint ``rsample_and_log_prob`` (tensordict >= 0.15 uses it) and kwargs."""

    def __init__(self, loc: torch.Tensor, scale: torch.Tensor, *, low: float, high: float) -> None:
        super().__init__(loc, scale)
        self.low, self.high = low, high

    def _squash(self, x: torch.Tensor) -> torch.Tensor:
        return self.low + (self.high - self.low) * (torch.tanh(x) + 1) / 2

    def rsample(self, sample_shape: Any = torch.Size()) -> torch.Tensor:  # noqa: B008
        return self._squash(super().rsample(sample_shape))

    def rsample_and_log_prob(self, sample_shape: Any = torch.Size()) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: B008
        raw = super().rsample(sample_shape)
        return self._squash(raw), super().log_prob(raw) - 7.0

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        return super().log_prob(value) + 1.0

    @property
    def deterministic_sample(self) -> torch.Tensor:
        return self._squash(self.loc)


def td_module() -> TensorDictModule:
    return TensorDictModule(mlp(4, 2), in_keys=OBS, out_keys=["action"])


def sequence() -> TensorDictSequential:
    """Three modules, one writing two out_keys, plus a nested and a private output."""
    return TensorDictSequential(
        TensorDictModule(mlp(4, 8), in_keys=OBS, out_keys=["hidden"]),
        TensorDictModule(TwoHeads(), in_keys=["hidden"], out_keys=["logits", ("stats", "value")]),
        TensorDictModule(
            lambda x: (x.argmax(-1), x * 0), in_keys=["logits"], out_keys=["action", "_scratch"]
        ),
    )


def categorical(return_log_prob: bool) -> ProbabilisticTensorDictSequential:
    return ProbabilisticTensorDictSequential(
        TensorDictModule(mlp(4, 2), in_keys=OBS, out_keys=["logits"]),
        ProbabilisticTensorDictModule(
            in_keys=["logits"],
            out_keys=["action"],
            distribution_class=D.Categorical,
            return_log_prob=return_log_prob,
            default_interaction_type=InteractionType.RANDOM,
        ),
    )


def normal(return_log_prob: bool) -> ProbabilisticTensorDictSequential:
    return ProbabilisticTensorDictSequential(
        TensorDictModule(mlp(4, 4), in_keys=OBS, out_keys=["params"]),
        TensorDictModule(NormalParamExtractor(), in_keys=["params"], out_keys=["loc", "scale"]),
        ProbabilisticTensorDictModule(
            in_keys=["loc", "scale"],
            out_keys=["action"],
            distribution_class=D.Normal,
            return_log_prob=return_log_prob,
        ),
    )


def tanh_normal(return_log_prob: bool) -> ProbabilisticTensorDictSequential:
    return ProbabilisticTensorDictSequential(
        TensorDictModule(mlp(4, 4), in_keys=OBS, out_keys=["params"]),
        TensorDictModule(NormalParamExtractor(), in_keys=["params"], out_keys=["loc", "scale"]),
        ProbabilisticTensorDictModule(
            in_keys=["loc", "scale"],
            out_keys=["action"],
            distribution_class=TanhNormalLike,
            distribution_kwargs={"low": -2.0, "high": 2.0},
            return_log_prob=return_log_prob,
        ),
    )


def truncated_normal(return_log_prob: bool) -> ProbabilisticTensorDictSequential:
    return ProbabilisticTensorDictSequential(
        TensorDictModule(mlp(4, 4), in_keys=OBS, out_keys=["params"]),
        TensorDictModule(NormalParamExtractor(), in_keys=["params"], out_keys=["loc", "scale"]),
        ProbabilisticTensorDictModule(
            in_keys=["loc", "scale"],
            out_keys=["action"],
            distribution_class=TruncatedNormal,
            distribution_kwargs={"low": -1.0, "high": 1.0},
            return_log_prob=return_log_prob,
        ),
    )


def two_samplers(return_log_prob: bool) -> ProbabilisticTensorDictSequential:
    """Two probabilistic modules (return_composite): the first one's sample feeds the second."""
    return ProbabilisticTensorDictSequential(
        TensorDictModule(mlp(4, 2), in_keys=OBS, out_keys=["loc"]),
        ProbabilisticTensorDictModule(
            in_keys={"loc": "loc"},
            out_keys=["latent"],
            distribution_class=D.Normal,
            distribution_kwargs={"scale": 1.0},
        ),
        TensorDictModule(nn.Linear(2, 3), in_keys=["latent"], out_keys=["logits"]),
        ProbabilisticTensorDictModule(
            in_keys=["logits"],
            out_keys=["action"],
            distribution_class=D.Categorical,
            return_log_prob=return_log_prob,
        ),
    )


POLICIES: dict[str, Callable[[bool], Any]] = {
    "td_module": lambda lp: td_module(),
    "sequence": lambda lp: sequence(),
    "categorical": categorical,
    "normal": normal,
    "tanh_normal": tanh_normal,
    "truncated_normal": truncated_normal,
    "two_samplers": two_samplers,
}
INTERACTIONS = [None, *InteractionType]
SHAPES = [(), (5,), (2, 3)]


def outcome(runner: Callable[[Any], Any], obs: dict[Any, torch.Tensor]) -> Any:
    """The runner's output, or the type of the exception it raised (both paths must agree)."""
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            return runner(obs)
    except Exception as exc:
        return type(exc)


def steps(runner: Callable[[Any], Any], observations: list[Any], itype: Any, seed: int) -> list[Any]:
    torch.manual_seed(seed)
    ctx = set_interaction_type(itype) if itype is not None else contextlib.nullcontext()
    with ctx:
        return [outcome(runner, obs) for obs in observations]


def assert_same(fast_out: list[Any], slow_out: list[Any]) -> None:
    for a, b in zip(fast_out, slow_out, strict=True):
        if isinstance(b, type):  # both raise (a sequence wraps the error in a RuntimeError)
            assert isinstance(a, type) and issubclass(a, Exception)
        else:
            assert same_outputs(a, b), (a, b)


DETERMINISTIC_NETS = ("td_module", "sequence")
CASES = [(n, lp) for n in POLICIES for lp in (False, True) if not (lp and n in DETERMINISTIC_NETS)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("name", "lp"), CASES, ids=[f"{n}-{'lp' if lp else 'no_lp'}" for n, lp in CASES])
def test_fast_runner_is_bit_identical(name: str, shape: tuple[int, ...], lp: bool) -> None:
    torch.manual_seed(0)
    policy = POLICIES[name](lp)
    slow = _TensorDictRunner(policy, shape, OBS, None)
    fast = compile_tensordict_policy(policy, OBS, shape, None)
    assert fast is not None, unsupported_reason(policy, OBS, shape, None)
    observations = [{"observation": torch.randn(*shape, 4)} for _ in range(12)]
    for itype in INTERACTIONS:
        slow_out = steps(slow, observations, itype, seed=7)
        fast_out = steps(fast, observations, itype, seed=7)
        assert_same(fast_out, slow_out)
        ok = [o for o in slow_out if not isinstance(o, type)]
        if ok:  # which keys appear, their dtypes: what the TensorDict path gives
            assert list(ok[0]) == list(fast_out[0]) == slow.out_keys
            if lp and itype is not InteractionType.MEDIAN:
                assert any("log_prob" in str(k) for k in ok[0])


@pytest.mark.parametrize("name", ["sequence", "categorical", "normal"])
def test_make_runner_uses_the_fast_path_after_checking_it(name: str) -> None:
    torch.manual_seed(0)
    policy = POLICIES[name](True)
    runner = make_runner(policy, batch_shape=(3,), obs_keys=OBS, device=None)
    assert isinstance(runner, LazyFastRunner) and runner.uses_fast_path is None
    slow = _TensorDictRunner(policy, (3,), OBS, None)
    observations = [{"observation": torch.randn(3, 4)} for _ in range(10)]
    assert_same(
        steps(runner, observations, InteractionType.RANDOM, 3), steps(slow, observations, "random", 3)
    )
    assert runner.uses_fast_path is True
    assert runner.out_keys == slow.out_keys  # the slow runner's attributes show through


def test_policy_device_moves_inputs_as_the_tensordict_path_does() -> None:
    torch.manual_seed(0)
    policy = normal(True)
    device = torch.device("cpu")
    slow = _TensorDictRunner(policy, (2,), OBS, device)
    fast = compile_tensordict_policy(policy, OBS, (2,), device)
    assert fast is not None
    observations = [{"observation": torch.randn(2, 4, dtype=torch.float32)} for _ in range(5)]
    assert_same(steps(fast, observations, "random", 1), steps(slow, observations, "random", 1))


def test_verify_is_a_dry_run() -> None:
    torch.manual_seed(0)
    policy = categorical(True)
    obs = {"observation": torch.randn(4, 4)}
    fast = compile_tensordict_policy(policy, OBS, (4,), None)
    assert fast is not None
    state = torch.get_rng_state()
    with set_interaction_type("random"):
        assert verify_fast_runner(fast, _TensorDictRunner(policy, (4,), OBS, None), obs)
    assert torch.equal(torch.get_rng_state(), state)


def test_first_call_leaves_buffers_and_rng_as_the_slow_path_does() -> None:
    """The fast runner's dry call is undone: running statistics and the RNG stream are the slow path's."""

    def make() -> Any:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))
        return categorical_over(net)

    fast_policy, slow_policy = make(), make()
    runner = make_runner(fast_policy, batch_shape=(6,), obs_keys=OBS, device=None)
    slow = _TensorDictRunner(slow_policy, (6,), OBS, None)
    observations = [{"observation": torch.randn(6, 4)} for _ in range(4)]
    assert_same(steps(runner, observations, "random", 5), steps(slow, observations, "random", 5))
    assert runner.uses_fast_path is True
    for a, b in zip(fast_policy.buffers(), slow_policy.buffers(), strict=True):
        assert torch.equal(a, b)


def categorical_over(net: nn.Module) -> ProbabilisticTensorDictSequential:
    return ProbabilisticTensorDictSequential(
        TensorDictModule(net, in_keys=OBS, out_keys=["logits"]),
        ProbabilisticTensorDictModule(
            in_keys=["logits"], out_keys=["action"], distribution_class=D.Categorical, return_log_prob=True
        ),
    )


class OverriddenForward(TensorDictModule):
    def forward(self, tensordict: Any, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(tensordict, *args, **kwargs)
        out["action"] = out["action"] + 1
        return out


def _with_hook() -> TensorDictModule:
    module = td_module()
    module.register_forward_hook(lambda mod, args, out: out.set("action", out["action"] * 2))
    return module


def _selected() -> TensorDictSequential:
    seq = TensorDictSequential(
        TensorDictModule(mlp(4, 2), in_keys=OBS, out_keys=["logits"]),
        TensorDictModule(lambda x: x.argmax(-1), in_keys=["logits"], out_keys=["action"]),
    )
    return seq.select_out_keys("action")


UNSUPPORTED: dict[str, Callable[[], Any]] = {
    "dict_in_keys": lambda: TensorDictModule(
        lambda observation: observation * 2, {"observation": "observation"}, ["action"]
    ),
    "selected_out_keys": lambda: TensorDictSequential(
        TensorDictModule(mlp(4, 2), in_keys=OBS, out_keys=["logits"]),
        TensorDictModule(lambda x: x.argmax(-1), in_keys=["logits"], out_keys=["action"]),
        selected_out_keys=["action"],
    ),
    "select_out_keys_hook": _selected,
    "partial_tolerant": lambda: TensorDictSequential(td_module(), partial_tolerant=True),
    "subclass_forward": lambda: OverriddenForward(mlp(4, 2), in_keys=OBS, out_keys=["action"]),
    "forward_hook": _with_hook,
    "inplace_false": lambda: TensorDictModule(mlp(4, 2), in_keys=OBS, out_keys=["action"], inplace=False),
    "plain_callable_in_sequence": lambda: TensorDictSequential(
        td_module(), lambda td: td.set("x", td["action"])
    ),
    "missing_in_key": lambda: TensorDictModule(
        nn.Bilinear(4, 4, 2), in_keys=["observation", "h"], out_keys=["action"]
    ),
    "composite_distribution": lambda: ProbabilisticTensorDictSequential(
        TensorDictModule(mlp(4, 2), in_keys=OBS, out_keys=[("params", "action", "logits")]),
        ProbabilisticTensorDictModule(
            in_keys=["params"],
            out_keys=["action"],
            distribution_class=CompositeDistribution,
            distribution_kwargs={"distribution_map": {"action": D.Categorical}},
        ),
    ),
    "generator": lambda: ProbabilisticTensorDictSequential(
        TensorDictModule(mlp(4, 2), in_keys=OBS, out_keys=["logits"]),
        ProbabilisticTensorDictModule(
            in_keys=["logits"], out_keys=["action"], distribution_class=D.Categorical, generator=3
        ),
    ),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_constructs_keep_the_tensordict_path(name: str) -> None:
    try:
        torch.manual_seed(0)
        policy, twin = UNSUPPORTED[name](), None
        torch.manual_seed(0)
        twin = UNSUPPORTED[name]()  # the same weights (and generator state) for the reference run
    except TypeError as exc:  # a construct this tensordict version does not have
        pytest.skip(str(exc))
    assert compile_tensordict_policy(policy, OBS, (3,), None) is None
    assert unsupported_reason(policy, OBS, (3,), None)
    runner = make_runner(policy, batch_shape=(3,), obs_keys=OBS, device=None)
    assert isinstance(runner, _TensorDictRunner)
    obs = {"observation": torch.randn(3, 4)}
    expected = _TensorDictRunner(twin, (3,), OBS, None)
    assert_same(steps(runner, [obs], "random", 0), steps(expected, [obs], "random", 0))


def test_a_mismatch_on_the_first_call_falls_back_for_good() -> None:
    """A module whose outputs differ between two calls from the same RNG state: never fast."""
    calls = iter(range(100))
    policy = TensorDictModule(lambda obs: obs.sum(-1) + next(calls), in_keys=OBS, out_keys=["action"])
    runner = make_runner(policy, batch_shape=(2,), obs_keys=OBS, device=None)
    assert isinstance(runner, LazyFastRunner)
    obs = {"observation": torch.zeros(2, 4)}
    assert runner(obs)["action"].tolist() == [1.0, 1.0]  # call 0 was the fast dry run
    assert runner.uses_fast_path is False
    assert runner(obs)["action"].tolist() == [2.0, 2.0]


def test_an_output_of_another_kind_later_falls_back() -> None:
    """The first call shows tensors, a later one a dict: the TensorDict path takes over."""
    calls = iter(range(100))

    def fn(obs: torch.Tensor) -> Any:
        n = next(calls)
        return obs.sum(-1) if n < 4 else {"action": obs.sum(-1) + 1}

    runner = make_runner(
        TensorDictModule(fn, in_keys=OBS, out_keys=["action"]), batch_shape=(2,), obs_keys=OBS, device=None
    )
    obs = {"observation": torch.zeros(2, 4)}
    for _ in range(3):
        assert runner(obs)["action"].tolist() == [0.0, 0.0]
    assert runner.uses_fast_path is True
    assert runner(obs)["action"].tolist() == [1.0, 1.0]
    assert runner.uses_fast_path is False


def test_compiled_policies_keep_the_tensordict_path() -> None:
    policy = td_module()
    with warnings.catch_warnings():  # torch's own import-time deprecation chatter
        warnings.simplefilter("ignore", DeprecationWarning)
        compiled = torch.compile(policy, backend="eager")
    runner = make_runner(compiled, batch_shape=(3,), obs_keys=OBS, device=None)
    assert isinstance(runner, _TensorDictRunner)


@contextlib.contextmanager
def fast_path(enabled: bool) -> Iterator[None]:
    previous, _fast_policy.ENABLED = _fast_policy.ENABLED, enabled
    try:
        yield
    finally:
        _fast_policy.ENABLED = previous


def collect(
    policy: Any, *, num_envs: int | None, enabled: bool, exploration: str, env_id: str = "CartPole-v1"
) -> list[TensorDict]:
    async def main() -> list[TensorDict]:
        out = []
        with anyio.fail_after(120):
            async with Collector(
                lambda: GymEnv(env_id, num_envs=num_envs),
                policy,
                frames_per_batch=40,
                total_frames=120,
                seed=11,
                exploration_type=exploration,
            ) as collector:
                runner = collector._rollout.policy
                assert isinstance(runner, LazyFastRunner) is enabled
                async for batch in collector:
                    out.append(batch)
                if enabled:
                    assert runner.uses_fast_path is True
        return out

    with fast_path(enabled):
        return anyio.run(main)


@pytest.mark.parametrize("exploration", ["random", "deterministic"])
@pytest.mark.parametrize("num_envs", [None, 4])
def test_seeded_collector_batches_are_bit_identical(num_envs: int | None, exploration: str) -> None:
    torch.manual_seed(0)
    policy = ProbabilisticTensorDictSequential(
        TensorDictModule(mlp(4, 2), in_keys=OBS, out_keys=["logits"]),
        ProbabilisticTensorDictModule(
            in_keys=["logits"], out_keys=["action"], distribution_class=D.Categorical, return_log_prob=True
        ),
    )
    fast = collect(policy, num_envs=num_envs, enabled=True, exploration=exploration)
    slow = collect(policy, num_envs=num_envs, enabled=False, exploration=exploration)
    assert len(fast) == len(slow) == 3
    for a, b in zip(fast, slow, strict=True):
        assert list(a.keys(True, True)) == list(b.keys(True, True))
        for key in b.keys(True, True):
            assert a[key].dtype == b[key].dtype
            assert torch.equal(a[key], b[key]), key


class Noisy(nn.Module):
    """``loc`` plus torch-RNG noise, clipped: a sampling module that is not a distribution."""

    def forward(self, loc: torch.Tensor) -> torch.Tensor:
        return (loc + 0.1 * torch.randn_like(loc)).clamp(-2.0, 2.0)


class OneTuple(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.tanh(x),)


def chain(n_in: int = 4, n_out: int = 2) -> TensorDictSequential:
    """Single-input, single-output modules, each reading the one before's output: FastRunner.one's chain."""
    return TensorDictSequential(
        TensorDictModule(mlp(n_in, n_out), in_keys=OBS, out_keys=["loc"]),
        TensorDictModule(OneTuple(), in_keys=["loc"], out_keys=[("nested", "squashed")]),
        TensorDictModule(Noisy(), in_keys=[("nested", "squashed")], out_keys=["action"]),
    )


def not_chains() -> dict[str, TensorDictSequential]:
    """Sequences :meth:`FastRunner.one` calls through the dict of keys (still bit-identical)."""
    return {
        "reads_the_observation_twice": TensorDictSequential(
            TensorDictModule(mlp(4, 2), in_keys=OBS, out_keys=["loc"]),
            TensorDictModule(lambda obs: obs[..., :2] * 2, in_keys=OBS, out_keys=["action"]),
        ),
        "overwrites_an_output": TensorDictSequential(
            TensorDictModule(mlp(4, 2), in_keys=OBS, out_keys=["action"]),
            TensorDictModule(Noisy(), in_keys=["action"], out_keys=["action"]),
        ),
        "overwrites_the_observation": TensorDictSequential(
            TensorDictModule(lambda obs: obs * 2, in_keys=OBS, out_keys=OBS),
            TensorDictModule(mlp(4, 2), in_keys=OBS, out_keys=["action"]),
        ),
        "out_keys_in_tree_order": TensorDictSequential(
            TensorDictModule(mlp(4, 2), in_keys=OBS, out_keys=[("a", "x")]),
            TensorDictModule(torch.tanh, in_keys=[("a", "x")], out_keys=["b"]),
            TensorDictModule(Noisy(), in_keys=["b"], out_keys=[("a", "action")]),
        ),
    }


def chain2() -> TensorDictSequential:
    """Two links (``FastRunner.one``'s unrolled case), the first giving a 1-tuple."""
    return TensorDictSequential(
        TensorDictModule(nn.Sequential(mlp(4, 2), OneTuple()), in_keys=OBS, out_keys=["loc"]),
        TensorDictModule(Noisy(), in_keys=["loc"], out_keys=["action"]),
    )


ONE_CASES = {
    "chain": chain,
    "chain2": chain2,
    "chain1": td_module,
    **{name: (lambda n=name: not_chains()[n]) for name in not_chains()},
}


@pytest.mark.parametrize("shape", [(), (3,)], ids=str)
@pytest.mark.parametrize("name", list(ONE_CASES))
def test_one_input_of_a_decided_runner_is_bit_identical(name: str, shape: tuple[int, ...]) -> None:
    """What the fused loop calls (``one_input``): the fast runner as a function of the observation."""
    torch.manual_seed(0)
    policy = ONE_CASES[name]()
    runner = make_runner(policy, batch_shape=shape, obs_keys=OBS, device=None)
    assert isinstance(runner, LazyFastRunner)
    assert one_input(runner, "observation").__name__ == "<lambda>"  # undecided: through the runner
    slow = _TensorDictRunner(policy, shape, OBS, None)
    observations = [torch.randn(*shape, 4) for _ in range(8)]
    with torch.no_grad():
        runner({"observation": observations[0]})  # the first call decides
    assert runner.uses_fast_path is True
    one = one_input(runner, "observation")
    assert (runner.fast._chain_links("observation") is not None) is name.startswith("chain")
    fast_out = steps(lambda obs: one(obs["observation"]), [{"observation": o} for o in observations], None, 3)
    slow_out = steps(slow, [{"observation": o} for o in observations], None, 3)
    assert_same(fast_out, slow_out)
    assert list(fast_out[0]) == slow.out_keys


def test_one_input_takes_the_tensordict_path_under_skip_existing() -> None:
    torch.manual_seed(0)
    policy = chain()
    runner = make_runner(policy, batch_shape=(2,), obs_keys=OBS, device=None)
    assert isinstance(runner, LazyFastRunner)
    obs = torch.randn(2, 4)
    with torch.no_grad():
        runner({"observation": obs})
        one = one_input(runner, "observation")
        calls = []
        slow = runner.slow
        runner.slow = lambda o: calls.append(1) or slow(o)  # type: ignore[method-assign]
        one(obs)
        assert not calls
        with set_skip_existing(True):
            one(obs)
        assert calls == [1]
    assert runner.uses_fast_path is True


def test_one_input_falls_back_when_a_link_gives_another_kind() -> None:
    calls = iter(range(100))

    def fn(obs: torch.Tensor) -> Any:
        n = next(calls)
        return obs.sum(-1) if n < 3 else {"action": obs.sum(-1) + 1}

    runner = make_runner(
        TensorDictModule(fn, in_keys=OBS, out_keys=["action"]), batch_shape=(2,), obs_keys=OBS, device=None
    )
    assert isinstance(runner, LazyFastRunner)
    obs = torch.zeros(2, 4)
    assert runner({"observation": obs})["action"].tolist() == [0.0, 0.0]  # calls 0 (dry) and 1
    one = one_input(runner, "observation")
    assert runner.fast._chain_links("observation") is not None
    assert one(obs)["action"].tolist() == [0.0, 0.0]  # call 2
    assert one(obs)["action"].tolist() == [1.0, 1.0]  # call 3 diverges, call 4 on the TensorDict path
    assert runner.uses_fast_path is False
    assert one(obs)["action"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("num_envs", [None, 4])
def test_seeded_collector_batches_of_a_chain_are_bit_identical(num_envs: int | None) -> None:
    """Pendulum (a float Box action) with a chain that samples: the fused loop's fast path against the
    TensorDict path, batch for batch."""
    torch.manual_seed(0)
    policy = chain(3, 1)
    fast = collect(policy, num_envs=num_envs, enabled=True, exploration="random", env_id="Pendulum-v1")
    slow = collect(policy, num_envs=num_envs, enabled=False, exploration="random", env_id="Pendulum-v1")
    assert len(fast) == len(slow) == 3
    for a, b in zip(fast, slow, strict=True):
        assert list(a.keys(True, True)) == list(b.keys(True, True))
        for key in b.keys(True, True):
            assert a[key].dtype == b[key].dtype
            assert torch.equal(a[key], b[key]), key


def torchrl_policies() -> dict[str, Callable[[], Any]]:
    torchrl_modules = pytest.importorskip("torchrl.modules")

    def params() -> TensorDictModule:
        return TensorDictModule(nn.Sequential(mlp(4, 4), NormalParamExtractor()), OBS, ["loc", "scale"])

    return {
        "actor": lambda: torchrl_modules.Actor(mlp(4, 2)),
        "safe_sequential": lambda: torchrl_modules.SafeSequential(
            torchrl_modules.SafeModule(mlp(4, 4), OBS, ["hidden"]),
            torchrl_modules.SafeModule(nn.Linear(4, 2), ["hidden"], ["action"]),
        ),
        "probabilistic_actor_tanh_normal": lambda: torchrl_modules.ProbabilisticActor(
            params(),
            in_keys=["loc", "scale"],
            distribution_class=torchrl_modules.TanhNormal,
            distribution_kwargs={"low": -2.0, "high": 2.0},
            return_log_prob=True,
        ),
        "probabilistic_actor_one_hot": lambda: torchrl_modules.ProbabilisticActor(
            TensorDictModule(mlp(4, 3), OBS, ["logits"]),
            in_keys=["logits"],
            distribution_class=torchrl_modules.OneHotCategorical,
            return_log_prob=True,
        ),
    }


@pytest.mark.filterwarnings("ignore::UserWarning")  # torchrl's TanhNormal warns on MEDIAN and the like
@pytest.mark.parametrize("shape", [(), (5,)], ids=str)
@pytest.mark.parametrize(
    "name", ["actor", "safe_sequential", "probabilistic_actor_tanh_normal", "probabilistic_actor_one_hot"]
)
def test_torchrl_actors_are_bit_identical(name: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    policy = torchrl_policies()[name]()
    slow = _TensorDictRunner(policy, shape, OBS, None)
    fast = compile_tensordict_policy(policy, OBS, shape, None)
    assert fast is not None, unsupported_reason(policy, OBS, shape, None)
    observations = [{"observation": torch.randn(*shape, 4)} for _ in range(8)]
    for itype in INTERACTIONS:
        assert_same(steps(fast, observations, itype, seed=5), steps(slow, observations, itype, seed=5))


def test_torchrl_safe_actor_keeps_the_tensordict_path() -> None:
    torchrl_modules = pytest.importorskip("torchrl.modules")
    from torchrl.data import Bounded

    actor = torchrl_modules.Actor(mlp(4, 2), spec=Bounded(-0.1, 0.1, (2,)), safe=True)
    assert compile_tensordict_policy(actor, OBS, (3,), None) is None
    assert isinstance(make_runner(actor, batch_shape=(3,), obs_keys=OBS, device=None), _TensorDictRunner)

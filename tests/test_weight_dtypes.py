"""Weights of another dtype than the policy's: refused with an error naming the entry and both dtypes,
before anything is published; only lossless float widenings are cast (``_weights.LOSSLESS_CASTS``)."""

from __future__ import annotations

import pytest
import torch

from aiocollect import Collector
from aiocollect._policies._weights import LOSSLESS_CASTS, check_compatible, copy_weights, flat_weights
from support import pendulum

pytestmark = pytest.mark.anyio


class Constant(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.value = torch.nn.Parameter(torch.zeros(1))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.value.expand(*observation.shape[:-1], 1).clone()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float64, torch.complex64])
def test_a_lossy_dtype_is_refused_naming_the_entry(dtype: torch.dtype) -> None:
    target = flat_weights(torch.nn.Linear(3, 2))
    source = target.apply(lambda t: t.detach().to(dtype))
    with pytest.raises(ValueError, match=rf"'bias' has dtype {dtype}, the policy's has torch.float32"):
        check_compatible(target, source)


@pytest.mark.parametrize(("source", "target"), sorted(LOSSLESS_CASTS, key=str))
def test_a_lossless_widening_is_cast_exactly(source: torch.dtype, target: torch.dtype) -> None:
    module = torch.nn.Linear(3, 2).to(target)
    weights = flat_weights(module)
    new = weights.apply(lambda t: torch.randn(t.shape).to(source))
    check_compatible(weights, new)
    copy_weights(weights, new)
    assert module.weight.dtype == target
    torch.testing.assert_close(module.weight.detach(), new["weight"].to(target), rtol=0, atol=0)


async def test_int64_weights_for_a_float_parameter_are_refused_before_publishing() -> None:
    policy = Constant()
    async with Collector(pendulum, policy, frames_per_batch=4) as collector:
        with pytest.raises(ValueError, match=r"'value' has dtype torch.int64"):
            await collector.update_weights({"value": torch.ones(1, dtype=torch.int64)})
        assert collector.policy_version == 0
        assert await collector.update_weights({"value": torch.ones(1, dtype=torch.float16)}) == 1

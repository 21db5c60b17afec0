"""The loop rotation of ``--loop-tier`` (tests/conftest.py): a test's instances share one key whatever their
loop, each tier keeps one loop per test, and CI's three tiers between them give every test every loop."""

from __future__ import annotations

import itertools

import pytest

from conftest import LOOPS, rotation_key, tier_loop

NODES = [
    "tests/test_a.py::test_plain",
    "tests/test_a.py::test_b[sync]",
    "tests/test_faults.py::test_env_policy_and_factory_errors[cause-collector-{loop}-step-mid]",
    "tests/test_x.py::test_y[{loop}]",
    "tests/test_x.py::test_y[{loop}-anyio_backend0]",
    "tests/test_x.py::test_z[{loop}-CartPole-v1-3]",
]
#: a loop's ids in node ids: conftest's own fixture, and the labels the matrices of other modules use
IDS = {"asyncio": ["asyncio"], "uvloop": ["asyncio+uvloop", "uvloop"], "trio": ["trio"]}


@pytest.mark.parametrize("node", NODES)
def test_a_tests_instances_share_their_key_whatever_the_loop(node: str) -> None:
    keys = {rotation_key(node.format(loop=label)) for labels in IDS.values() for label in labels}
    assert len(keys) == 1
    (key,) = keys
    assert all(label not in key.split("[")[-1].split("-") for labels in IDS.values() for label in labels)


def test_other_ids_stay_in_the_key() -> None:
    assert rotation_key("t.py::f[asyncio-sync-CartPole-v1]") == "t.py::f[sync-CartPole-v1]"
    assert rotation_key("t.py::f[trio-sync]") != rotation_key("t.py::f[trio-async]")
    assert rotation_key("t.py::f") == "t.py::f"


@pytest.mark.parametrize("loops", [list(LOOPS), ["asyncio", "trio"], ["uvloop"]], ids=["3", "2", "1"])
def test_the_three_tiers_give_every_test_each_of_its_loops(loops: list[str]) -> None:
    for i in range(200):
        key = f"tests/test_{i}.py::test_{i}[x]"
        chosen = [tier_loop(key, loops, tier) for tier in range(3)]
        assert set(chosen) == set(loops), (key, chosen)
        assert chosen[0] == tier_loop(key, list(reversed(loops)), 0)  # the order given does not matter


def test_the_first_tier_spreads_the_tests_over_the_loops() -> None:
    keys = [f"tests/test_{a}.py::test_{b}" for a, b in itertools.product(range(30), range(10))]
    counts = {loop: sum(tier_loop(k, list(LOOPS), 0) == loop for k in keys) for loop in LOOPS}
    assert all(counts[loop] > len(keys) / 6 for loop in LOOPS), counts


def test_the_choice_is_stable() -> None:
    """The same in every process (CI's three runs are three processes): a checksum, not ``hash()``."""
    assert [tier_loop("tests/test_a.py::test_b[sync]", list(LOOPS), t) for t in range(3)] == [
        tier_loop("tests/test_a.py::test_b[sync]", list(LOOPS), t) for t in range(3)
    ]
    assert {tier_loop("k", list(LOOPS), t) for t in (0, 3, 6)} == {tier_loop("k", list(LOOPS), 0)}

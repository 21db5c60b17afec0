"""The cancellation-safe waiter table (``aiocollect._transport._waiters``) used by the remote collectors."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from aiocollect._transport._waiters import WaiterTable

pytestmark = [pytest.mark.anyio, pytest.mark.all_loops]  # waiters: every loop in the README's run


async def test_reply_reaches_its_waiter():
    table = WaiterTable()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            with table.expect("k") as waiter:
                tg.start_soon(lambda: _resolve_later(table, "k", 7))
                assert await waiter.wait() == 7
    assert len(table) == 0


async def _resolve_later(table: WaiterTable, key: str, value: object) -> None:
    await anyio.lowlevel.checkpoint()
    table.resolve(key, value)


async def test_cancelled_waiter_is_forgotten_and_late_reply_is_orphaned():
    orphans: list[tuple[object, object]] = []
    table = WaiterTable(on_orphan=lambda key, value: orphans.append((key, value)))
    with anyio.move_on_after(0.01) as scope:
        with table.expect("k") as waiter:
            await waiter.wait()
    assert scope.cancelled_caught
    assert len(table) == 0
    assert table.resolve("k", "late") is False
    assert orphans == [("k", "late")]


async def test_reply_to_a_waiter_cancelled_before_it_took_it_is_orphaned():
    orphans: list[tuple[object, object]] = []
    table = WaiterTable(on_orphan=lambda key, value: orphans.append((key, value)))
    with anyio.CancelScope() as scope:
        with table.expect("k") as waiter:
            assert table.resolve("k", "batch") is True
            scope.cancel()
            await waiter.wait()  # cancelled before it returns the value
    assert orphans == [("k", "batch")]


async def test_failure_wakes_every_waiter_and_later_expect_raises():
    table = WaiterTable()
    error = RuntimeError("node 1 died")
    results: list[BaseException] = []

    async def wait(key: str) -> None:
        with table.expect(key) as waiter:
            try:
                await waiter.wait()
            except RuntimeError as exc:
                results.append(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, "a")
            tg.start_soon(wait, "b")
            await anyio.wait_all_tasks_blocked()
            table.fail(error)
    assert results == [error, error]
    with pytest.raises(RuntimeError, match="node 1 died"):
        table.expect("c")


def test_a_key_waited_for_twice_is_a_bug():
    table = WaiterTable()
    table.expect("k")
    with pytest.raises(RuntimeError, match="waits for 'k' already"):
        table.expect("k")

"""When a capture stops waiting for its guest to settle (controller/settle.py), on a vCPU clock the
test drives (a real guest's is in tests/test_snapshots.py: settled, and a claim at Ready)."""

from __future__ import annotations

import asyncio
import time

import pytest

from vmsidecar_runtime.controller import settle
from vmsidecar_runtime.controller.settle import (
    AT_READY,
    LIMIT,
    REQUESTED,
    SETTLED,
    settle_limit,
    until_settled,
)


class VcpuClock:
    """The vCPUs' CPU time: busy (a whole core) until ``busy_until`` (monotonic), idle after."""

    def __init__(self, busy_for: float) -> None:
        self.busy_until = time.monotonic() + busy_for
        self.started = time.monotonic()

    def __call__(self) -> float:
        return min(time.monotonic(), self.busy_until) - self.started


@pytest.fixture(autouse=True)
def short_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settle, "SETTLE_WINDOW_S", 0.05)


async def test_a_guest_busy_then_idle_settles_after_its_quiet_windows() -> None:
    started = time.monotonic()
    assert await until_settled(VcpuClock(0.3), 10, []) == SETTLED
    waited = time.monotonic() - started
    # busy 0.3 s, then QUIET_WINDOWS quiet windows of 0.05 s; the first of them may hold the busy part's
    # last moments (less than QUIET_SHARE of a window is quiet): measured 0.698 s against 0.7 once
    earliest = 0.3 + settle.QUIET_WINDOWS * 0.05 - settle.QUIET_SHARE * 0.05
    assert earliest <= waited < 3, waited


async def test_a_guest_that_never_idles_is_captured_at_the_limit() -> None:
    started = time.monotonic()
    assert await until_settled(VcpuClock(60), 0.4, []) == LIMIT
    assert 0.4 <= time.monotonic() - started < 3


async def test_an_operation_that_wants_the_guest_ends_the_wait_at_once() -> None:
    wanted = asyncio.Event()
    asyncio.get_running_loop().call_later(0.1, wanted.set)
    started = time.monotonic()
    assert await until_settled(VcpuClock(60), 30, [asyncio.Event(), wanted]) == REQUESTED
    assert time.monotonic() - started < 1


async def test_no_wait_when_the_vcpus_cannot_be_read_or_the_limit_is_zero() -> None:
    assert await until_settled(lambda: None, 30, []) == AT_READY
    assert await until_settled(VcpuClock(60), 0, []) == AT_READY
    gone = iter([1.0, 1.0, None])  # the process ended while the guest settled
    assert await until_settled(lambda: next(gone), 30, []) == AT_READY


@pytest.mark.parametrize(("raw", "limit"), [(None, 30.0), ("0", 0.0), ("12.5", 12.5), ("soon", 30.0), ("-1", 30.0)])
def test_the_limit_from_the_environment(monkeypatch: pytest.MonkeyPatch, raw: str | None, limit: float) -> None:
    if raw is None:
        monkeypatch.delenv(settle.SETTLE_ENV, raising=False)
    else:
        monkeypatch.setenv(settle.SETTLE_ENV, raw)
    assert settle_limit() == limit

"""A restored guest's wall clock: it resumes at the capture instant, so every restore of a snapshot
whose guest held the guest agent's port open sets the clock to the host's through the agent.

A new boot's restore is Ready before its clock is set (under TCG the agent's first round trip is
most of a Debian recycle, and nothing of a lease reaches the guest meanwhile): the next claim, and
the console input, wait for it (docs/decisions.md, "Ready before the clock").
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..backend import guest_agent
from ..snapshots import Snapshot

log = logging.getLogger(__name__)

#: bound on reaching the agent after a restore (it answers a sync in ~10 ms when it is there)
CLOCK_TIMEOUT_S = 5.0
CLOCK_CORRECTED = "corrected"
CLOCK_NO_AGENT = "no guest agent"
#: a restored guest's clock is being set (it is Ready; claims wait for the outcome)
CLOCK_SETTING = "setting"
#: bound on a claim's wait for a clock being set: the clock's own bound, and the restore's start
CLAIM_WAIT_S = CLOCK_TIMEOUT_S + 10.0


def has_guest_agent(snap: Snapshot) -> bool:
    """Whether ``snap``'s guest held the agent's port open at its capture (its restores set the clock)."""
    meta = snap.meta()
    return meta is not None and meta.guest_agent


def already_set() -> asyncio.Event:
    """The event of a boot with no clock to wait for."""
    event = asyncio.Event()
    event.set()
    return event


async def until_set(clock_set: asyncio.Event) -> None:
    """Return once ``clock_set`` is (a restored guest's clock set, or failed), or after
    ``CLAIM_WAIT_S``: nothing hangs on a clock."""
    try:
        await asyncio.wait_for(clock_set.wait(), CLAIM_WAIT_S)
    except TimeoutError:
        log.warning("waited %.0f s for a restored guest's clock to be set, and went on", CLAIM_WAIT_S)


async def correct_clock(has_agent: bool, agent: guest_agent.GuestAgent | None) -> str:
    """Set the restored guest's clock to the host's when the capture found an agent
    (``has_agent``, as the snapshot's meta records it); what happened (``snapshot.clock`` of
    ``GET /v1/vm``). Returns once the agent has read ``guest-set-time`` (it sets the clock then),
    not at its answer, which waits for ``hwclock -w`` (up to ~2.6 s). ``agent`` is the backend's
    session on the agent's socket (``Backend.guest_agent``)."""
    if not has_agent:
        return CLOCK_NO_AGENT
    if agent is None:
        return "failed: the runtime holds no session on the guest agent's socket (see the log)"
    started = time.monotonic()
    try:
        answered = await agent.set_time(CLOCK_TIMEOUT_S)
    except guest_agent.GuestAgentError as e:
        log.warning("the restored guest's clock was not corrected: %s", e.message)
        return f"failed: {e.message}"
    log.info("restored guest's clock set to the host's in %.2f s%s", time.monotonic() - started,
             "" if answered else " (the agent is still writing the RTC)")
    return CLOCK_CORRECTED

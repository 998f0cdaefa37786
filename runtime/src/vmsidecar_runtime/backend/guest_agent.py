"""A small qemu-guest-agent (QGA) client: set the guest's clock (whether a guest runs an agent is
seen from QMP's VSERPORT_CHANGE, ``backend/qemu.py``).

QGA speaks QMP's JSON, one object per line, but with no greeting and no capabilities
negotiation; qemu.qmp's ``QMPClient`` waits for a greeting first, so it does not fit and the
lines are written and read here. The channel can hold stale replies (a previous command's, or one
the guest wrote just before a snapshot was taken), so every command goes after a
``guest-sync-delimited`` with a random id: the agent answers with a 0xFF byte and the id, and
everything before that answer is dropped. The 0xFF the client sends first resets the agent's
parser after a half-written request.

The backend holds one session for each QEMU's life, from before its guest runs (:func:`hold`): QGA
on a virtio-serial port whose host side nobody holds reads EOF, sleeps 100 ms and reads again
(``channel_event_cb`` in qga/main.c), which cost an idle Debian guest's QEMU 1.7-2.3 % of a core
under TCG, 0.7 % with the session held (its agent then waits in ``poll()``). A snapshot taken so
keeps its agent waiting that way, and a restore connects before the load, so QEMU never tells the
restored guest that the host side closed (virtio-serial compares it after a load).

Every call is bounded; a guest with no agent (nothing reads the port) is a ``NoGuestAgent``
after the bound, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: QGA replies are small; a longer line is not a reply of ours
LINE_LIMIT = 1 << 20


class GuestAgentError(Exception):
    """The agent answered with an error, or the exchange failed."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NoGuestAgent(GuestAgentError):
    """No agent answered within the bound (none installed, not started, or the port is missing)."""


class NoAnswer(GuestAgentError):
    """The agent took the command but did not answer within the bound."""


class GuestAgent:
    """One session on the agent's socket (QEMU serves one client at a time: the backend's)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        #: a command whose answer is still being read after its caller went on (``set_time``)
        self._late: asyncio.Task[Any] | None = None

    @classmethod
    async def connect(cls, path: Path, timeout: float = 1.0) -> GuestAgent:
        """Open a session.

        :raise GuestAgentError: when QEMU's agent socket cannot be reached.
        """
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path, limit=LINE_LIMIT), timeout)
        except (OSError, TimeoutError) as e:
            raise GuestAgentError(f"cannot reach the guest agent's socket {path} ({e or 'timeout'})") from e
        return cls(reader, writer)

    async def close(self) -> None:
        """End the session (a late answer still read is given up)."""
        await self._forget_late()
        self._writer.close()
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            await asyncio.wait_for(self._writer.wait_closed(), 1)

    async def _forget_late(self) -> None:
        """Stop reading an earlier command's late answer: the next command's sync drops it."""
        late, self._late = self._late, None
        if late is not None and not late.done():
            late.cancel()
            with contextlib.suppress(asyncio.CancelledError, GuestAgentError, TimeoutError):
                await late

    async def _reply(self, match: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        """The next reply ``match`` accepts; stale and foreign replies are skipped."""
        async with asyncio.timeout(timeout):
            await self._writer.drain()
            while True:
                try:
                    line = await self._reader.readline()
                except ValueError:  # an over-long line: not ours (the reader dropped it)
                    continue
                if not line:
                    raise GuestAgentError("QEMU closed the guest agent's socket")
                # a delimited answer starts after the agent's 0xFF, whatever junk came before it
                text = line.rsplit(b"\xff", 1)[-1].strip()
                try:
                    message = json.loads(text)
                except (ValueError, RecursionError):  # nested past the parser: a guest's junk too
                    continue
                if isinstance(message, dict) and match(message):
                    return message

    async def execute_read(self, command: str, arguments: dict[str, Any], read: asyncio.Event, *,
                           timeout: float) -> Any:
        """Run ``command``, set ``read`` once the agent has read it, and return its ``return`` value.

        One write, one round trip: a 0xFF (resets the agent's parser after a half-written request
        of an earlier client), a ``guest-sync-delimited`` and the command. The sync's answer
        starts with the agent's own 0xFF, so whatever stale output the channel held before it is
        dropped. The agent answers a command only once it has run it; ``read`` comes sooner: one
        small write is one chunk of QEMU's chardev read, one buffer of the guest's virtio-serial
        port and one ``read()`` of the agent, which parses and dispatches in order, so the sync's
        answer means the command was read with it and is run next, whatever its own answer waits
        for. Under TCG a restored guest retranslates its code, and each round trip costs ~0.1 s:
        a separate sync first doubled the cost of setting a restored guest's clock.

        :raise NoGuestAgent: nothing answered the sync within ``timeout`` (no agent reads the port).
        :raise GuestAgentError: the agent's error, or no answer within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        sync_id = secrets.randbelow(2**31 - 1) + 1
        ident = f"vmsidecar-{secrets.token_hex(4)}"
        self._writer.write(b"\xff" + json.dumps({"execute": "guest-sync-delimited", "arguments": {"id": sync_id}}).encode()
                           + b"\n" + json.dumps({"execute": command, "arguments": arguments, "id": ident}).encode()
                           + b"\n")
        try:
            await self._reply(lambda m: m.get("return") == sync_id, timeout)
        except TimeoutError:
            raise NoGuestAgent(f"{command}: no guest agent read it within {timeout:g} s") from None
        read.set()
        try:
            reply = await self._reply(lambda m: m.get("id") == ident, max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            raise NoAnswer(f"{command}: no answer within {timeout:g} s") from None
        if "error" in reply:
            error = reply["error"]
            desc = error.get("desc", error) if isinstance(error, dict) else error
            raise GuestAgentError(f"{command}: {_said(desc)}")
        return reply.get("return")

    async def set_time(self, timeout: float) -> bool:
        """Set the guest's clock to the host's (``guest-set-time``; the agent also writes the RTC).

        QGA calls ``settimeofday`` as soon as it reads the command and only then runs
        ``hwclock -w``, which waits for the RTC's next second (0.6-2.6 s measured under TCG); the
        answer comes after both. So this returns once the agent has read the command
        (:meth:`execute_read`), not at its answer, which is read in the background (the agent's
        error is logged then; the session's next command or its end stops that). True when the
        agent had answered by then.

        :raise GuestAgentError: naming what failed (no sync within ``timeout``, the agent's error).
        """
        await self._forget_late()
        read = asyncio.Event()
        task = asyncio.create_task(self.execute_read("guest-set-time", {"time": time.time_ns()}, read,
                                                     timeout=timeout))
        waiter = asyncio.create_task(read.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if task.done():
            task.result()  # the agent's error, if any
            return True
        task.add_done_callback(_log_late_error)
        self._late = task
        return False


async def hold(path: Path) -> GuestAgent | None:
    """The session a backend holds on its QEMU's agent socket from before the guest runs (see the
    module's docstring); None, logged, when the socket cannot be reached (the clock is then not set)."""
    try:
        return await GuestAgent.connect(path)
    except GuestAgentError as e:
        log.warning("no session on the guest agent's socket: %s", e.message)
        return None


#: characters of an agent's error kept: it is the guest's text, shown in ``GET /v1/vm`` and the log
SAID_CHARS = 200


def _said(desc: object) -> str:
    """An agent's error text on one line (control characters escaped: the guest may write what
    looks like log lines of ours) and bounded."""
    text = str(desc)
    cut = text[:SAID_CHARS]
    return cut.encode("unicode_escape").decode("ascii") + ("…" if len(text) > SAID_CHARS else "")


def _log_late_error(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("guest-set-time's late answer: %s", task.exception())

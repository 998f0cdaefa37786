"""The host's GPIO control socket (``<shared>/gpio.sock``): JSON lines, one reply per request, in order.

::

    {"op": "list"}                                   -> {"ok": true, "lines": [{name, offset, direction, value, ...}]}
    {"op": "get", "line": NAME}                      -> {"ok": true, "value": 0|1}
    {"op": "set", "line": NAME, "value": 0|1}        -> {"ok": true, "value": 0|1}   (direction "in" lines only)
    {"op": "wait", "line": NAME, "for": "rising"|"falling"|"active"|"inactive", "timeout": S|null}
                                                     -> {"ok": true, "value": 0|1} | {"ok": false, "error": "timeout", ...}

A request may name the generation its lease claimed (``"generation": N``, as the API's
``Vmsidecar-Generation`` header; the exporter's drivers always do): it is carried out only while the
VM is at that generation and claimed, else ``generation_changed`` (a tree of an ended lease, which
0.9.0 keeps running while it hands the next lease out, must act on nothing of the next).

Errors: ``{"ok": false, "error": CODE, "message": SENTENCE}``, CODE one of bad_request, no_line,
not_host_driven, bad_value, bad_wait, timeout, closed, busy, generation_changed (and internal for a
bug). Directions are the guest's view: ``in`` lines are driven by the host, ``out`` lines by the
guest. The exporter's drivers (``jumpstarter_driver_vmsidecar.gpio``) open one connection per call.

A wait's ``timeout`` is 0 to ``MAX_WAIT_S`` seconds (the contract's ``endpoints.is_wait``), or null:
until the condition holds. Either way the wait ends (and its connection with it) when its client
hangs up or the lease ends (``closed``): the device outlives leases, so nothing a lease left waiting
may stay. A client that closes its sending side (``echo … | socat``, ``shutdown(SHUT_WR)``) cannot be
told from one that left: it must keep the connection open until its answer. Past
:data:`MAX_CLIENTS` connections at once, a new one gets ``busy`` to its first request and is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vmsidecar_contract.endpoints import MAX_WAIT_S, is_wait
from vmsidecar_contract.errors import GuestError, RequestError, StateError, VmsidecarError

from ..perms import share
from .virtio_gpio import DIR_IN, DIR_NONE, DIR_OUT, Line, VirtioGpio

log = logging.getLogger(__name__)
#: the longest request line (asyncio's default; a request is a few dozen bytes)
LINE_LIMIT = 1 << 16
#: connections at once: the exporter opens one per call, so this is far past a lease's real use, and
#: bounds the fds (and waiters) a flood of calls can hold in the runtime
MAX_CLIENTS = 64
#: seconds a refused connection gets to send its request: the refusal answers it, and a socket
#: closed with a request unread would reset, losing the refusal
REFUSE_READ_S = 1.0

#: what a ``wait`` waits for: (old, new) -> done
CONDITIONS: dict[str, Callable[[int, int], bool]] = {
    "rising": lambda old, new: old == 0 and new == 1,
    "falling": lambda old, new: old == 1 and new == 0,
    "active": lambda _old, new: new == 1,
    "inactive": lambda _old, new: new == 0,
}


@dataclass(eq=False)
class _Waiter:
    """One pending ``wait``: resolved with the new value when its condition holds."""

    line: Line
    condition: Callable[[int, int], bool]
    future: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class GpioControlServer:
    """Serves ``gpio.sock`` for one :class:`~.virtio_gpio.VirtioGpio`."""

    def __init__(self, model: VirtioGpio, require_generation: Callable[[int], None] | None = None) -> None:
        self.model = model
        #: raises ``GenerationChangedError`` unless the VM is at this claimed generation (the lease's rule)
        self._require_generation = require_generation
        self._server: asyncio.Server | None = None
        self._path: Path | None = None
        self._clients: set[asyncio.StreamWriter] = set()
        self._waiters: set[_Waiter] = set()
        model.add_listener(self._changed)

    async def listen(self, path: Path) -> None:
        """Serve ``path``, mode 0660, handed to the socket owner like every shared socket."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        # never world-connectable, not even between bind and chmod: the process umask (perms.restrict_umask)
        self._server = await asyncio.start_unix_server(self._serve, path=str(path), limit=LINE_LIMIT)
        share(path, 0o660)
        self._path = path

    async def close(self) -> None:
        """Stop serving, remove the socket, and fail every pending wait with ``closed``."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None
        self._drop("the GPIO device was removed (spec changed or runtime stopping)")

    def end_lease(self) -> None:
        """The lease ended: fail its pending waits with ``closed`` and close its connections; the
        socket keeps serving the next lease."""
        self._drop("the lease ended (the VM is being recycled)")

    def _drop(self, why: str) -> None:
        for writer in list(self._clients):
            writer.close()
        # also the waits whose connection cannot see the close: a request queued behind the wait
        for waiter in list(self._waiters):
            if not waiter.future.done():
                waiter.future.set_exception(StateError(why, code="closed"))

    async def wait(self, name: str, until: str, timeout: float | None) -> int:
        """Wait for an edge (``rising``/``falling``) or a level (``active``/``inactive``); returns the value.

        :raise NotFoundError: (``no_line``) for an unknown line.
        :raise RequestError: (``bad_wait``) for an unknown condition.
        :raise GuestError: (``timeout``) when it does not happen within ``timeout`` seconds.
        :raise StateError: (``closed``) when the device goes away meanwhile.
        """
        line = self.model.line(name)
        condition = CONDITIONS.get(until)
        if condition is None:
            raise RequestError(f"cannot wait for {until!r}; use rising, falling, active or inactive", code="bad_wait")
        if (until == "active" and line.value == 1) or (until == "inactive" and line.value == 0):
            return line.value
        waiter = _Waiter(line, condition)
        self._waiters.add(waiter)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError:
            raise GuestError(f"line {name!r} did not go {until} within {timeout} s", code="timeout") from None
        finally:
            self._waiters.discard(waiter)

    def _changed(self, line: Line, old: int, new: int) -> None:
        for waiter in list(self._waiters):
            if waiter.line is line and not waiter.future.done() and waiter.condition(old, new):
                waiter.future.set_result(new)

    def describe(self) -> list[dict[str, object]]:
        """The ``list`` reply's lines."""
        dirs = {DIR_NONE: "none", DIR_OUT: "out", DIR_IN: "in"}
        return [
            {"name": x.name, "offset": x.offset, "direction": x.direction, "value": x.value,
             "guest_direction": dirs.get(x.guest_direction, "?"), "irq_type": x.irq_type, "armed": x.armed is not None}
            for x in self.model.lines
        ]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._clients) >= MAX_CLIENTS:
            with contextlib.suppress(TimeoutError, ValueError, OSError):
                await asyncio.wait_for(reader.readline(), REFUSE_READ_S)
            await _last_word(writer, "busy", f"the GPIO control socket serves at most {MAX_CLIENTS} "
                             "connections at once (each pending wait holds one); end some and retry")
            return
        self._clients.add(writer)
        request = asyncio.ensure_future(reader.readline())
        reply: asyncio.Future[dict[str, Any]] | None = None
        try:
            while line := await request:
                reply = asyncio.ensure_future(self._reply(line))
                # read on meanwhile: only a read sees the client hang up, which must end its wait (else
                # it holds its waiter and this fd until the line changes); a request read waits its turn
                request = asyncio.ensure_future(reader.readline())
                await asyncio.wait((reply, request), return_when=asyncio.FIRST_COMPLETED)
                if not reply.done() and _hung_up(request):
                    break
                writer.write(json.dumps(await reply).encode() + b"\n")
                await writer.drain()
        except ValueError:  # a line past the reader's limit: said, then the connection ends (framing lost)
            await _last_word(writer, RequestError.code, f"a request line is longer than {LINE_LIMIT} bytes; "
                             "send one JSON object per line")
        except (ConnectionError, OSError):
            pass  # the client went away; its waits end with it
        finally:
            for task in (request, reply):
                if task is not None and not task.cancel() and not task.cancelled():
                    task.exception()  # seen: a read failing once its client left is no news
            self._clients.discard(writer)
            writer.close()

    async def _reply(self, raw: bytes) -> dict[str, Any]:
        """The reply to one request line; every failure is a reply, never a closed socket."""
        try:
            return await self._request(_parse(raw))
        except VmsidecarError as e:
            return {"ok": False, "error": e.code, "message": e.message}
        except Exception as e:  # a bug must cost one request, never the control socket
            log.exception("gpio: control request %r failed", raw[:200])
            return {"ok": False, "error": "internal", "message": f"the runtime failed to serve this request ({e})"}

    async def _request(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        rid = {"id": req["id"]} if "id" in req else {}
        if "generation" in req:
            self._check_generation(req["generation"])
        if op == "list":
            return {"ok": True, "lines": self.describe(), **rid}
        if op == "get":
            return {"ok": True, "value": self.model.line(req.get("line")).value, **rid}
        if op == "set":
            return {"ok": True, "value": self.model.drive(str(req.get("line")), req.get("value")), **rid}
        if op == "wait":
            value = await self.wait(str(req.get("line")), str(req.get("for")), _timeout(req.get("timeout")))
            return {"ok": True, "value": value, **rid}
        raise RequestError(f"op {op!r} is unknown; use list, get, set or wait")

    def _check_generation(self, value: object) -> None:
        """:raise RequestError: not a generation.
        :raise GenerationChangedError: not the VM's generation, or unclaimed."""
        if type(value) is not int or not 0 <= value < 1 << 63:  # (bool is an int to isinstance)
            raise RequestError(f"generation must be the whole number the lease claimed; got {value!r:.40}")
        if self._require_generation is not None:
            self._require_generation(value)


def _parse(raw: bytes) -> dict[str, Any]:
    """One request line as a JSON object.

    :raise RequestError: (``bad_request``) when it is not one.
    """
    with contextlib.suppress(ValueError, RecursionError):  # RecursionError: nested past the parser
        req = json.loads(raw)
        if isinstance(req, dict):
            return req
    raise RequestError('send one JSON object per line, e.g. {"op": "list"}')


def _hung_up(read: asyncio.Future[bytes]) -> bool:
    """Whether a finished read is the client's end (EOF, a reset) rather than its next request."""
    if not read.done():
        return False
    error = read.exception()
    return isinstance(error, OSError) if error is not None else not read.result()


async def _last_word(writer: asyncio.StreamWriter, code: str, message: str) -> None:
    """An error reply, then the connection ends."""
    writer.write(json.dumps({"ok": False, "error": code, "message": message}).encode() + b"\n")
    with contextlib.suppress(OSError):
        await writer.drain()
    writer.close()


def _timeout(value: object) -> float | None:
    """A ``wait`` timeout: 0 to ``MAX_WAIT_S`` seconds, or null for none.

    :raise RequestError: (``bad_wait``) for anything else (NaN and Infinity are JSON to Python).
    """
    if value is None:
        return None
    if is_wait(value):
        return float(value)
    raise RequestError(f"timeout must be a number of seconds from 0 to {MAX_WAIT_S:g}, or null; "
                       f"got {value!r:.100}", code="bad_wait")

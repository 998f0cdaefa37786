"""NDJSON answers: the event stream's lines and every progress stream (one line per JSON object).

A progress stream is ``ProgressLine``s: progress (at most one per ``PROGRESS_INTERVAL_S``, and the
last), then one ``result`` with the VM state or one ``error`` with the error body. Its work runs as
a task after the 200: a refusal found before that is a real error status, one found during it is
an ``error`` line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web

from vmsidecar_contract.endpoints import MEDIA_TYPES
from vmsidecar_contract.errors import VmsidecarError
from vmsidecar_contract.state import VmState

from .. import metrics
from .audit import STREAM_ERROR_KEY

#: the least time between two progress lines (and how often the stream checks for its client); the
#: result line is written as soon as the work ends
PROGRESS_INTERVAL_S = 0.2
Progress = Callable[[int, int | None], None]


async def open_stream(request: web.Request) -> web.StreamResponse:
    """Send the 200 of an NDJSON stream."""
    response = web.StreamResponse(headers={"Content-Type": MEDIA_TYPES["ndjson"]})
    await response.prepare(request)
    return response


async def write_line(response: web.StreamResponse, line: dict[str, Any] | str) -> None:
    """One line: a dict as JSON, or a str that is JSON already."""
    await response.write((line if isinstance(line, str) else json.dumps(line)).encode() + b"\n")


def client_gone(request: web.Request) -> bool:
    """Whether the client went away: aiohttp does not cancel a handler whose client left, and a
    stream that has nothing to write (a stalled registry, a filter that never matches) would never
    find out by writing."""
    return request.transport is None or request.transport.is_closing()


async def progress_stream(request: web.Request, work: Callable[[Progress], Coroutine[Any, Any, VmState]], *,
                          cancel: Callable[[str], None], release: Callable[[], None]) -> web.StreamResponse:
    """Answer with a progress stream of ``work`` (called with the progress callback, from any thread).

    ``work`` belongs to this stream: when the client goes away (or the stream breaks) before it
    ends, ``cancel`` is called with why (nobody would see its result); when the stream cannot even
    begin, ``work`` never starts and ``release`` is called.
    """
    task: asyncio.Task[VmState] | None = None
    try:
        response = await open_stream(request)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def progress(done: int, total: int | None) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, {"type": "progress", "done": done, "total": total})

        task = asyncio.create_task(work(progress))
        task.add_done_callback(_retrieve)
        last_sent = 0.0
        while not task.done() or not queue.empty():
            if client_gone(request):
                request[STREAM_ERROR_KEY] = "transfer_cancelled"
                cancel("its client went away")
                await asyncio.wait({task})
                return response
            # woken by a progress line or by the work's end, whichever first (the result line is
            # not held back by the interval), and at least every interval to look for the client
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, task}, timeout=PROGRESS_INTERVAL_S, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()  # an item it had not taken stays in the queue
                with contextlib.suppress(asyncio.CancelledError):
                    await getter
            if getter.done() and not getter.cancelled():
                line = getter.result()
                now = loop.time()
                if now - last_sent >= PROGRESS_INTERVAL_S or line.get("done") == line.get("total"):
                    await write_line(response, line)
                    last_sent = now
        try:
            final: dict[str, Any] = {"type": "result", "state": task.result().model_dump(mode="json")}
        except VmsidecarError as e:
            final = {"type": "error", **e.to_dict()}
            request[STREAM_ERROR_KEY] = e.code
            metrics.error(e.code)
        await write_line(response, final)
        await response.write_eof()
        return response
    finally:
        if task is None:
            release()
        elif not task.done():  # the stream broke (the client left mid-write) or the server stops
            cancel("its client went away")


def _retrieve(task: asyncio.Task[Any]) -> None:
    """The result of work whose client left is nobody's: read it so asyncio does not warn."""
    if not task.cancelled():
        task.exception()

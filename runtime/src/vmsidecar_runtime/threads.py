"""Blocking work a caller may give up on: in a daemon thread of its own, and stoppable.

The event loop's default executor (``asyncio.to_thread``) has min(32, CPUs + 4) threads, and
Python 3.11's ``asyncio.run`` waits for every one of them at exit, without a bound. Work whose pace a
lease holder sets (a pull from their registry, ``qemu-img`` reading their image) must not run
there: a registry that trickles keeps a thread inside one socket read for ever (each read gets a
byte before its timeout), a cancel of the awaiting coroutine does not reach the thread, and a few
such pulls took every thread of the pool (a recycle's clean-up then queued behind them with the
power lock held) and held the runtime's exit.

So such work runs in a daemon thread of its own (:func:`run_abortable`), and its caller's cancel
sets the work's :class:`Abort`, which also undoes what blocks the thread: the transport shuts down
the sockets it reads (``shutdown(SHUT_RDWR)`` wakes a ``recv`` blocked on it), :func:`.procs.run`
kills the program it waits for. The work finds its :class:`Abort` with :func:`current_abort`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: how long a cancelled caller waits for its thread to end once its Abort is set (the thread's own
#: clean-up, e.g. a partial file removed, then happens before the cancellation goes on); a thread
#: still blocked after it is left behind: a daemon, it holds neither the pool nor the exit
GRACE_S = 2.0


class Abandoned(BaseException):
    """Raised in a thread whose work was given up (:meth:`Abort.check`). A BaseException, so that no
    ``except Exception`` on the way turns it into an image error; clean-ups (``except
    BaseException``, ``finally``) still run."""


class Abort(threading.Event):
    """A thread's stop signal: set, it also runs the hooks registered with :meth:`on_set` (at once
    for one registered after), each of which undoes something the thread may be blocked in."""

    def __init__(self) -> None:
        super().__init__()
        self._hooks_lock = threading.Lock()
        self._hooks: dict[int, Callable[[], None]] = {}
        self._next = 0

    def set(self) -> None:
        with self._hooks_lock:
            super().set()
            hooks, self._hooks = list(self._hooks.values()), {}
        for hook in hooks:
            with contextlib.suppress(OSError):  # a socket closed meanwhile, a process gone
                hook()

    def on_set(self, hook: Callable[[], None]) -> Callable[[], None]:
        """Run ``hook`` when this is set (now, if it is); returns what unregisters it."""
        with self._hooks_lock:
            if not self.is_set():
                key, self._next = self._next, self._next + 1
                self._hooks[key] = hook
                return lambda: self._remove(key)
        with contextlib.suppress(OSError):
            hook()
        return lambda: None

    def _remove(self, key: int) -> None:
        with self._hooks_lock:
            self._hooks.pop(key, None)

    def check(self) -> None:
        """:raise Abandoned: once set."""
        if self.is_set():
            raise Abandoned


#: the Abort of the work the current thread runs for (:func:`run_abortable`), if any
_current: contextvars.ContextVar[Abort | None] = contextvars.ContextVar("vmsidecar_abort", default=None)


def current_abort() -> Abort | None:
    """The :class:`Abort` of the work this thread runs, or None (work nobody gives up)."""
    return _current.get()


def in_daemon_thread(fn: Callable[..., T], *args: Any, name: str, abort: Abort | None = None
                     ) -> asyncio.Future[T]:
    """``fn(*args)`` in a new daemon thread, in a copy of the caller's context (the registry settings
    are context variables) with ``abort`` as :func:`current_abort`; its outcome on the returned
    future (also when the loop has stopped waiting: it is dropped then)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def work() -> T:
        _current.set(abort)  # in the copied context: the caller's stays as it was
        return fn(*args)

    def run() -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = context.run(work)
        except BaseException as e:  # handed to the waiting side as it is
            error = e
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


async def run_abortable(fn: Callable[..., T], *args: Any, name: str, abort: Abort | None = None,
                        grace: float = GRACE_S) -> T:
    """``fn(*args)`` in a daemon thread (:func:`in_daemon_thread`), awaited. Cancelled, the caller
    sets ``abort`` (a new one when None), waits up to ``grace`` seconds for the thread to end, and
    goes on with its cancellation; what the thread ends with is read either way (an unread
    exception would be a traceback in the log)."""
    abort = abort if abort is not None else Abort()
    done = in_daemon_thread(fn, *args, name=name, abort=abort)
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        abort.set()
        done.add_done_callback(_retrieve)
        await asyncio.wait({done}, timeout=grace)
        raise


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()

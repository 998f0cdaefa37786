"""The exporter's own Prometheus metrics: leases served, driver calls by method and outcome, lease
durations (issue 22). Served by ``metrics_http`` when the single-process exporter is given
``--metrics-listen``; counted in every mode (nothing is served unless asked).

Driver calls are counted by wrapping our drivers' exported methods (``metered_driver`` on each
driver class) rather than jumpstarter's dispatch (``Driver.DriverCall`` and friends, upstream's
gRPC servicer): the wrapper sees our methods only, so the ``method`` label is a fixed set
(``VmPower.on``, ``VmStorage.flash_oci``…), never a name a lease holder chose — a call to a method
that does not exist is refused by jumpstarter before it reaches us and is not counted.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from inspect import isasyncgenfunction, iscoroutinefunction
from typing import Any, TypeVar

from jumpstarter.driver.decorators import (
    MARKER_DRIVERCALL,
    MARKER_MAGIC,
    MARKER_STREAMCALL,
    MARKER_STREAMING_DRIVERCALL,
)
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

#: no ``*_created`` series, as in the runtime's metrics: they double the exposition for nothing
disable_created_metrics()
#: the exporter's registry (not prometheus_client's global one: only these metrics are served)
REGISTRY = CollectorRegistry(auto_describe=True)

LEASES = Counter("vmsidecar_exporter_leases", "Leases this exporter served (counted when the lease claims the VM)",
                 registry=REGISTRY)
DRIVER_CALLS = Counter("vmsidecar_exporter_driver_calls",
                       "Calls of the VM drivers' exported methods, by method and outcome "
                       "(a stream counts once, when it opens)",
                       ["method", "outcome"], registry=REGISTRY)
#: leases last from a minute of CI to a working day at a desk
LEASE_DURATION = Histogram("vmsidecar_exporter_lease_duration_seconds",
                           "How long a lease held the VM, from its claim to the end of its session",
                           buckets=(10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800),
                           registry=REGISTRY)

OUTCOMES = ("ok", "error")
_MARKERS = (MARKER_DRIVERCALL, MARKER_STREAMING_DRIVERCALL, MARKER_STREAMCALL)

C = TypeVar("C", bound=type)


def lease_started() -> float:
    """Count a lease; the monotonic time to hand to ``lease_ended``."""
    LEASES.inc()
    return time.monotonic()


def lease_ended(started: float) -> None:
    LEASE_DURATION.observe(time.monotonic() - started)


def _exported_as(func: Any) -> str | None:
    return next((m for m in _MARKERS if getattr(func, m, None) == MARKER_MAGIC), None)


def _metered(func: Callable[..., Any], marker: str, label: str) -> Callable[..., Any]:
    """``func`` counting its calls; the same kind of callable, so jumpstarter dispatches it as before
    (functools.wraps copies the export marker along with the name and docstring)."""
    ok, error = (DRIVER_CALLS.labels(label, outcome) for outcome in OUTCOMES)

    if marker == MARKER_STREAMCALL:  # an @asynccontextmanager: counted when the stream opens (or fails to)
        @functools.wraps(func)
        @asynccontextmanager
        async def stream(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
            async with AsyncExitStack() as stack:
                try:
                    value = await stack.enter_async_context(func(*args, **kwargs))
                except BaseException:
                    error.inc()
                    raise
                ok.inc()
                # what happens to an open stream is the connection's business (a client hanging up is no error)
                yield value

        return stream
    if isasyncgenfunction(func):
        @functools.wraps(func)
        async def streaming(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
            gen = func(*args, **kwargs)
            try:
                async for item in gen:
                    yield item
            except GeneratorExit:  # the caller stopped reading: its choice, not a failure
                ok.inc()
                raise
            except BaseException:
                error.inc()
                raise
            finally:
                await gen.aclose()
            ok.inc()

        return streaming
    if iscoroutinefunction(func):
        @functools.wraps(func)
        async def call(*args: Any, **kwargs: Any) -> Any:
            try:
                result = await func(*args, **kwargs)
            except BaseException:
                error.inc()
                raise
            ok.inc()
            return result

        return call

    @functools.wraps(func)
    def sync_call(*args: Any, **kwargs: Any) -> Any:  # jumpstarter runs these in a worker thread
        try:
            result = func(*args, **kwargs)
        except BaseException:
            error.inc()
            raise
        ok.inc()
        return result

    return sync_call


def metered_driver(cls: C) -> C:
    """Class decorator: every method the class exports (its own or inherited) counts its calls as
    ``vmsidecar_exporter_driver_calls_total{method="Class.method"}``; both outcomes start at 0."""
    for name in dir(cls):
        func = getattr(cls, name, None)
        marker = _exported_as(func)
        if func is None or marker is None or getattr(func, "__vmsidecar_metered__", False):
            continue
        wrapped = _metered(func, marker, f"{cls.__name__}.{name}")
        wrapped.__vmsidecar_metered__ = True  # type: ignore[attr-defined]
        setattr(cls, name, wrapped)
    return cls

"""Event bus: one filtered queue per listener, scoped with ``async with``.

Serves both API subscribers (``GET /v1/events``) and internal waits. Every event is a contract
``Event``, its data checked against its type's model (``vmsidecar_contract.events.EVENTS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from vmsidecar_contract.events import Event

__all__ = ["Event", "EventBus"]


class EventBus:
    """Fan-out of events to listeners; a listener that falls behind loses its oldest events."""

    def __init__(self, maxsize: int = 1000) -> None:
        self._queues: set[tuple[asyncio.Queue[Event], frozenset[str] | None]] = set()
        self._maxsize = maxsize
        self.generation = 0

    def publish(self, type_: str, **data: Any) -> Event:
        """Send an event to every listener interested in its type.

        :raise pydantic.ValidationError: for a type or data the contract does not document (a bug).
        """
        event = Event(type=type_, time=time.time(), generation=self.generation, data=data)
        for queue, types in list(self._queues):
            if types is None or type_ in types:
                if queue.full():
                    queue.get_nowait()
                queue.put_nowait(event)
        return event

    @contextlib.asynccontextmanager
    async def listen(self, types: Iterable[str] | None = None) -> AsyncIterator[asyncio.Queue[Event]]:
        """A queue receiving the events (of ``types``, or all) published while open."""
        entry = (asyncio.Queue[Event](self._maxsize), frozenset(types) if types is not None else None)
        self._queues.add(entry)
        try:
            yield entry[0]
        finally:
            self._queues.discard(entry)

"""Readiness of one boot: the spec's regex seen on the chosen console, or a timeout with the tail."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

from vmsidecar_contract.errors import GuestError, SpecError, VmsidecarError
from vmsidecar_contract.spec import VmSpec

from ..console import ConsoleHub

#: bytes of console output kept to match a pattern split across chunks
WINDOW = 4096


class ReadinessWatch:
    """Arms a watcher per boot; calls ``on_ready`` once, or ``on_error`` with the reason."""

    def __init__(self, on_ready: Callable[[], None], on_error: Callable[[VmsidecarError], None]) -> None:
        self._on_ready = on_ready
        self._on_error = on_error
        self._task: asyncio.Task[None] | None = None

    def arm(self, spec: VmSpec, hubs: dict[str, ConsoleHub]) -> None:
        """Start watching this boot (an earlier watch is dropped)."""
        self.disarm()
        if spec.readiness.pattern is None:
            self._on_ready()
            return
        hub = hubs.get(spec.readiness.console)
        if hub is None:
            self._on_error(SpecError(f"readiness console {spec.readiness.console} is not enabled in the spec; "
                                     "enable virtio_console or watch ttyS0"))
            return
        self._task = asyncio.create_task(self._watch(hub, spec), name="readiness")

    def disarm(self) -> None:
        """Stop watching (the boot ended or a new one began)."""
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        self._task = None

    async def _watch(self, hub: ConsoleHub, spec: VmSpec) -> None:
        assert spec.readiness.pattern is not None
        pattern = re.compile(spec.readiness.pattern.encode())
        seen = asyncio.Event()
        window = bytearray()

        def on_data(data: bytes) -> None:
            window.extend(data)
            if pattern.search(window):
                seen.set()
            del window[:-WINDOW]

        with hub.watch(on_data):
            try:
                await asyncio.wait_for(seen.wait(), spec.readiness.timeout)
            except TimeoutError:
                tail = hub.tail(800).strip().replace("\r", "")
                self._on_error(GuestError(
                    f"the guest did not print {spec.readiness.pattern!r} on {spec.readiness.console} within "
                    f"{spec.readiness.timeout:.0f} s (console tail: {tail[-400:]!r}); check the image boots, "
                    "or change readiness.pattern/timeout"))
                return
        self._on_ready()

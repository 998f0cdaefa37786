"""Readiness of one boot: the effective readiness's regex (``readiness_rules.py``) seen on the
chosen console, or a timeout with the tail."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable

from vmsidecar_contract.errors import GuestError, ImageError, SpecError, VmsidecarError
from vmsidecar_contract.spec import VmSpec, compile_readiness_pattern

from ..console import ConsoleHub
from ..disk import DiskImage
from ..readiness_rules import EffectiveReadiness, effective_readiness

#: bytes of console output kept to match a pattern split across chunks: the regex (RE2, linear) runs
#: on this tail plus the bytes that came since the last search, however long the guest has been printing
WINDOW = 4096
#: console bytes waiting for a search, at most: the oldest go only when more came during one search
#: (a pattern built to be slow takes ~20-60 µs a byte; the default 0.002 µs), so the memory and one
#: search's time (≤ 15 s) stay bounded
PENDING = 256 * 1024
#: one thread for every watch's searches: RE2 releases the GIL, so a pattern that is linear yet slow
#: (counted repeats that overflow RE2's DFA cache) does not hold the loop (the API, recycle, signals)
#: behind each console chunk, and the searches of watches a reset storm left behind queue here
#: instead of taking the default executor's threads from the disk operations
_SEARCHES = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="readiness")


class ReadinessWatch:
    """Arms a watcher per boot; calls ``on_ready`` once, or ``on_error`` with the reason."""

    def __init__(self, on_ready: Callable[[], None], on_error: Callable[[VmsidecarError], None]) -> None:
        self._on_ready = on_ready
        self._on_error = on_error
        self._task: asyncio.Task[None] | None = None

    def arm(self, spec: VmSpec, hubs: dict[str, ConsoleHub], disk: DiskImage | None = None) -> None:
        """Start watching this boot of ``disk`` (an earlier watch is dropped)."""
        self.disarm()
        try:
            eff = effective_readiness(spec, disk)
        except ImageError as e:
            self._on_error(e)
            return
        readiness = eff.readiness
        if readiness.pattern is None:
            self._on_ready()
            return
        hub = hubs.get(readiness.console)
        if hub is None:
            self._on_error(SpecError(f"readiness console {readiness.console} (from the {eff.source}) is not "
                                     "enabled in the spec; enable virtio_console or watch ttyS0"))
            return
        self._task = asyncio.create_task(self._watch(hub, eff), name="readiness")

    def disarm(self) -> None:
        """Stop watching (the boot ended or a new one began)."""
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        self._task = None

    async def _watch(self, hub: ConsoleHub, eff: EffectiveReadiness) -> None:
        readiness = eff.readiness
        assert readiness.pattern is not None
        # RE2: linear in the text, so no pattern (spec or image) can stall the loop on guest output
        try:
            pattern = compile_readiness_pattern(readiness.pattern)
        except ValueError as e:  # checked when the spec was read; a spec from before RE2 lands here
            self._on_error(SpecError(f"{e}; set readiness.pattern in RE2 syntax"))
            return
        arrived = asyncio.Event()
        pending = bytearray()

        def on_data(data: bytes) -> None:
            pending.extend(data)
            del pending[:-PENDING]
            arrived.set()

        async def search() -> None:
            tail = b""
            while True:
                await arrived.wait()
                arrived.clear()
                text = tail + bytes(pending)
                pending.clear()
                found = await asyncio.get_running_loop().run_in_executor(_SEARCHES, pattern.search, text)
                if found is not None:
                    return
                tail = text[-WINDOW:]

        with hub.watch(on_data):
            try:
                await asyncio.wait_for(search(), readiness.timeout)
            except TimeoutError:
                tail = hub.tail(800).strip().replace("\r", "")
                self._on_error(GuestError(
                    f"the guest did not print {readiness.pattern!r} on {readiness.console} within "
                    f"{readiness.timeout:.0f} s (readiness from the {eff.source}; "
                    f"console tail: {tail[-400:]!r}); "
                    "check the image boots, or set readiness.pattern/timeout (spec, --ready-pattern, or the "
                    "image's io.vmsidecar.readiness.* annotations)"))
                return
        self._on_ready()

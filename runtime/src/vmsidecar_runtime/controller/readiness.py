"""Readiness of one boot: the effective readiness's regex (``readiness_rules.py``) seen on the
chosen console, or a timeout with the tail."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from vmsidecar_contract.errors import GuestError, ImageError, SpecError, VmsidecarError
from vmsidecar_contract.spec import VmSpec, compile_readiness_pattern

from ..console import ConsoleHub
from ..disk import DiskImage
from ..readiness_rules import EffectiveReadiness, effective_readiness

#: bytes of console output kept to match a pattern split across chunks: the regex (RE2, linear) runs
#: on this tail plus the new chunk, however long the guest has been printing
WINDOW = 4096


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
        seen = asyncio.Event()
        window = bytearray()

        def on_data(data: bytes) -> None:
            if seen.is_set():
                return
            # the tail of earlier output plus this chunk (the hub reads at most 64 KiB): a match split
            # across chunks is found, and each byte is searched at most WINDOW / chunk times over
            window.extend(data)
            if pattern.search(window):
                seen.set()
            del window[:-WINDOW]

        with hub.watch(on_data):
            try:
                await asyncio.wait_for(seen.wait(), readiness.timeout)
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

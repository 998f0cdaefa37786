"""Storage: the standard FlasherInterface over the runtime's atomic flash and dump.

Local files stream from the client; http(s) URLs are fetched by the exporter; ``oci://REF`` is
pulled by the runtime itself (its cache, its credentials, digest-verified).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jumpstarter.driver import Driver, FlasherInterface, export

from vmsidecar_contract.client import RuntimeClient

if TYPE_CHECKING:
    from .driver import VirtualMachine

TARGETS = (None, "root", "disk")


def _check_target(target: str | None) -> None:
    if target not in TARGETS:
        raise ValueError(f"unknown flash target {target!r}; a VM has one disk: leave the target out or use 'root'")


@dataclass(kw_only=True)
class VmStorage(FlasherInterface, Driver):
    """``j vm storage flash FILE|URL|oci://REF`` and ``dump FILE``."""

    parent: VirtualMachine

    @classmethod
    def client(cls) -> str:
        return "jumpstarter_driver_vmsidecar.client.VmStorageClient"

    @export
    async def flash(self, source: Any, target: str | None = None) -> dict[str, Any]:
        """Replace the disk with an image streamed by the client or fetched from a URL (atomic)."""
        _check_target(target)
        power_off = self.parent.flash_power_off

        async with self.resource(source) as res:

            async def chunks() -> AsyncIterator[bytes]:
                async for chunk in res:
                    yield chunk

            state = await self.parent.link.call(lambda c: c.flash(chunks(), power_off=power_off))
        self.logger.info("flashed %s", state.image_digest)
        return {"digest": state.image_digest, "phase": state.phase.value}

    @export
    async def flash_oci(self, reference: str, target: str | None = None) -> AsyncGenerator[dict[str, Any], None]:
        """Pull ``reference`` in the runtime and make it the disk; yields progress, then the result."""
        _check_target(target)
        ref = reference.removeprefix("oci://")
        power_off = self.parent.flash_power_off
        queue: asyncio.Queue[tuple[int, int | None]] = asyncio.Queue()
        task = asyncio.create_task(self.parent.link.call(
            lambda c: c.flash_reference(ref, power_off=power_off, progress=lambda d, t: queue.put_nowait((d, t)))
        ))
        try:
            while not task.done():
                with contextlib.suppress(TimeoutError):
                    done, total = await asyncio.wait_for(queue.get(), 1.0)
                    while not queue.empty():  # report the latest only
                        done, total = queue.get_nowait()
                    yield {"type": "progress", "done": done, "total": total}
            state = await task
        finally:
            task.cancel()
        self.logger.info("flashed %s from %s", state.image_digest, ref)
        yield {"type": "result", "digest": state.image_digest, "phase": state.phase.value}

    @export
    async def dump(self, target: Any, partition: str | None = None) -> None:
        """Stream the disk (base plus this lease's changes, one qcow2) to the client; the VM must be off."""
        _check_target(partition)
        async with self.resource(target) as res:

            async def pump(client: RuntimeClient) -> None:
                async for chunk in client.dump_chunks():
                    await res.send(chunk)

            await self.parent.link.call(pump)

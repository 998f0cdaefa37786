"""Storage: the standard FlasherInterface over the runtime's atomic flash and dump.

Local files stream from the client; http(s) URLs are fetched by the exporter; ``oci://REF`` is
pulled by the runtime itself (its cache, its credentials, digest-verified).

A URL is the lease holder's choice, fetched (flash) or written to (dump) from inside the pod, with
headers they choose too: one naming the pod's loopback or a link-local address (the cloud metadata
service: ``Metadata-Flavor: Google`` is just a header) is refused unless the exporter config sets
``allow_local_urls`` (docs/security.md, threat model).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from jumpstarter.common.resources import PresignedRequestResource, Resource
from jumpstarter.driver import Driver, FlasherInterface, export
from pydantic import TypeAdapter

from vmsidecar_contract.client import RuntimeClient

from .metrics import metered_driver

if TYPE_CHECKING:
    from .driver import VirtualMachine

TARGETS = (None, "root", "disk")


def _check_target(target: str | None) -> None:
    if target not in TARGETS:
        raise ValueError(f"unknown flash target {target!r}; a VM has one disk: leave the target out or use 'root'")


def _local(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast


async def check_url(handle: Any, *, allow_local: bool) -> None:
    """Refuse a URL resource whose host is (or resolves to) the pod's loopback or a link-local address.

    :raise ValueError: naming the URL's host and the exporter config switch.
    """
    resource = TypeAdapter(Resource).validate_python(handle)
    if allow_local or not isinstance(resource, PresignedRequestResource):
        return
    parts = urlsplit(resource.url)
    host = parts.hostname or ""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, parts.port or 443, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return  # unresolvable: the fetch itself fails and says so
    if any(_local(str(info[4][0])) for info in infos):
        raise ValueError(
            f"the URL's host {parts.netloc} is this pod (loopback) or a link-local address such as the cloud "
            "metadata service, which a lease may not reach; serve the image elsewhere, or set allow_local_urls: "
            "true in the exporter config (a laptop, never a shared pod)")


@metered_driver
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
        await check_url(source, allow_local=self.parent.allow_local_urls)

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
        await check_url(target, allow_local=self.parent.allow_local_urls)
        async with self.resource(target) as res:

            async def pump(client: RuntimeClient) -> None:
                async for chunk in client.dump_chunks():
                    await res.send(chunk)

            await self.parent.link.call(pump)

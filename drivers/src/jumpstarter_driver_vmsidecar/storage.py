"""Storage: the standard FlasherInterface over the runtime's atomic flash and dump.

Local files stream from the client; http(s) URLs are fetched by the exporter; ``oci://REF`` is
pulled by the runtime itself (its cache, its credentials, digest-verified).

A URL is the lease holder's choice, fetched (flash) from inside the pod, with headers they choose
too: one naming, resolving to or redirecting to the pod's loopback or a link-local address (the
cloud metadata service: ``Metadata-Flavor: Google`` is just a header) is refused unless the
exporter config sets ``allow_local_urls`` (docs/security.md, threat model). A dump goes to the
client only (:data:`NO_DUMP_URL`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urljoin
from uuid import UUID

import aiohttp
import yarl
from aiohttp.abc import ResolveResult
from jumpstarter.common.resources import ClientStreamResource, PresignedRequestResource, Resource
from jumpstarter.driver import Driver, FlasherInterface, export
from jumpstarter.streams.aiohttp import AiohttpStreamReaderStream
from jumpstarter.streams.progress import ProgressStream
from pydantic import TypeAdapter

from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.reach import is_pod_local, resolves_to_pod

from .arguments import text
from .metrics import metered_driver
from .uploads import BoundedUploads

if TYPE_CHECKING:
    from .driver import VirtualMachine

TARGETS = (None, "root", "disk")


def _check_target(target: str | None) -> None:
    if target not in TARGETS:
        raise ValueError(f"unknown flash target {target!r}; a VM has one disk: leave the target out or use 'root'")


def _not_reachable(netloc: str, redirect: bool) -> ValueError:
    said = "a redirect names" if redirect else "the URL's host"
    return ValueError(
        f"{said} {netloc}: this pod (loopback) or a link-local address such as the cloud metadata service, "
        "which a lease may not reach; serve the image elsewhere, or set allow_local_urls: true in the "
        "exporter config (a laptop, never a shared pod)")


async def _check_location(url: str, *, redirect: bool = False) -> None:
    """Refuse ``url`` unless it is http(s) to a host that is not (and does not resolve to) this pod's
    loopback or a link-local address.

    :raise ValueError: naming the host and the exporter config switch.
    """
    said = f"{'a redirect to ' if redirect else ''}{url!r}"
    try:  # read as the fetch reads it (yarl): urlsplit refuses ports yarl takes (`:+80`)
        parts = yarl.URL(url, encoded=True)
        host, port = parts.raw_host, parts.port
    except ValueError as e:
        raise ValueError(f"{said} is not a URL the exporter can fetch ({e})") from None
    if parts.scheme.lower() not in ("http", "https") or not host:
        raise ValueError(f"{said} is not an http(s) URL with a host; give an http:// or https:// URL, a "
                         "local file or oci://REGISTRY/REPO:TAG")
    if await asyncio.to_thread(resolves_to_pod, host, port or 443):  # (unresolvable: the fetch says so)
        raise _not_reachable(parts.raw_authority, redirect)


def _resource(handle: Any) -> Resource:
    """The lease holder's handle, read once.

    :raise ValueError: not a handle (pydantic's ``ValidationError`` is one).
    """
    return TypeAdapter(Resource).validate_python(handle)


class _PublicResolver(aiohttp.ThreadedResolver):
    """Names resolved at connect time, refused when they resolve to the pod: the check before the
    fetch resolves the name once, and a name can resolve elsewhere the second time (DNS rebinding)."""

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
                      ) -> list[ResolveResult]:
        addresses = await super().resolve(host, port, family)
        if any(is_pod_local(a["host"]) for a in addresses):
            raise OSError(errno.EACCES, str(_not_reachable(host, redirect=False)))  # (aiohttp shows strerror)
        return addresses


#: transfer encodings the runtime decompresses itself (under its image limits), passed through as sent
PASSED_THROUGH = ("zstd", "gzip", "xz")


def _pass_through(resource: Resource) -> Resource:
    """``resource``, a client stream whose bytes the lease holder says are compressed, as a stream the
    exporter passes through unread: upstream inflates each received chunk whole in this process (a
    16 KB chunk of zstd became 512 MiB here), which holds the pool's credentials.

    :raise ValueError: an encoding the runtime does not decompress.
    """
    if not isinstance(resource, ClientStreamResource) or resource.x_jmp_content_encoding is None:
        return resource
    if resource.x_jmp_content_encoding not in PASSED_THROUGH:
        raise ValueError(f"an upload compressed as {resource.x_jmp_content_encoding!r} cannot be flashed; "
                         f"decompress it, or compress it with one of {', '.join(PASSED_THROUGH)}")
    return resource.model_copy(update={"x_jmp_content_encoding": None})


#: why ``dump`` takes no URL: jumpstarter 0.9.0's presigned PUT opens the request with the body as a
#: stream it hands to the driver only once the answer has come, which never comes without the body
#: (the call hung for its 7200 s timeout, the server seeing no request)
NO_DUMP_URL = ("dump to a URL is not supported (jumpstarter 0.9.0's upload of a dump never sends its body); "
               "dump to a local file (j vm storage dump FILE) and upload that")


async def _check_handle(resource: Resource, method: str | None, what: str, streams: dict[Any, Any], *,
                        allow_local: bool) -> None:
    """A URL asks for ``method`` (``None``: no URL is taken) from a host that is not the pod (unless
    ``allow_local``); a client stream names a stream of this driver.

    :raise ValueError: naming what is wrong (upstream: a stream it does not have is a bare ``KeyError``).
    """
    if isinstance(resource, PresignedRequestResource):
        if method is None:
            raise ValueError(NO_DUMP_URL)
        if resource.method != method:
            raise ValueError(f"{what} takes a URL to {method}, not to {resource.method}")
        if not allow_local:
            await _check_location(resource.url)
    if isinstance(resource, ClientStreamResource) and resource.uuid not in streams:
        raise ValueError(f"{what}: no stream {resource.uuid} was opened to this driver; send the file with "
                         f"the client's {what}")


@metered_driver
@dataclass(kw_only=True)
class VmStorage(BoundedUploads, FlasherInterface, Driver):
    """``j vm storage flash FILE|URL|oci://REF`` and ``dump FILE``."""

    parent: VirtualMachine
    uploads_reading: set[UUID] = field(default_factory=set, init=False)

    @classmethod
    def client(cls) -> str:
        return "jumpstarter_driver_vmsidecar.client.VmStorageClient"

    @contextlib.asynccontextmanager
    async def _refusing(self, resource: Resource) -> AsyncIterator[None]:
        """A refusal in the block closes the client's stream the call was given: unread, its client
        would wait for ever to finish sending (and the stream stay in ``resources``)."""
        try:
            yield
        except BaseException:
            if isinstance(resource, ClientStreamResource) and resource.uuid in self.resources:
                with contextlib.suppress(Exception):
                    await self.resources.pop(resource.uuid).aclose()
            raise

    @export
    async def flash(self, source: Any, target: str | None = None) -> dict[str, Any]:
        """Replace the disk with an image streamed by the client or fetched from a URL (atomic)."""
        power_off = self.parent.flash_power_off
        resource = _resource(source)
        async with self._refusing(resource):
            _check_target(target)
            await _check_handle(resource, "GET", "flash", self.resources,
                                allow_local=self.parent.allow_local_urls)
            resource = _pass_through(resource)

        # upstream annotates the handle str, and validates it as the Resource (a dict) clients send
        async with self.resource(resource.model_dump(mode="json")) as res:  # type: ignore[arg-type]

            async def chunks() -> AsyncIterator[bytes]:
                async for chunk in res:
                    yield chunk

            state = await self.parent.link.call(lambda c: c.flash(chunks(), power_off=power_off))
        self.logger.info("flashed %s", state.image_digest)
        return {"digest": state.image_digest, "phase": state.phase.value}

    @contextlib.asynccontextmanager
    async def _presigned_get(self, url: str, headers: dict[str, str], timeout: aiohttp.ClientTimeout,
                             max_redirects: int = 10) -> AsyncIterator[Any]:
        """Upstream's GET (redirects followed by hand, so signed URLs keep their encoding; credentials
        dropped across origins), with every redirect checked as the URL was, and names resolved at
        connect time by :class:`_PublicResolver`: a redirect is the lease holder's answer too."""
        local = self.parent.allow_local_urls
        connector = aiohttp.TCPConnector(resolver=None if local else _PublicResolver())
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            current_url, current_headers = url, headers
            for _ in range(max_redirects + 1):
                async with session.get(self._make_url(current_url), headers=current_headers,
                                       raise_for_status=True, allow_redirects=False) as resp:
                    if resp.status not in (301, 302, 303, 307, 308):
                        async with AiohttpStreamReaderStream(reader=resp.content) as stream:
                            yield ProgressStream(stream=stream, logging=True)
                            return
                    location = resp.headers.get("Location", "")
                    if not location:
                        raise RuntimeError(
                            f"a redirect without a Location from {self._redact_url(current_url)}")
                    location = urljoin(current_url, location)
                    if not local:
                        await _check_location(location, redirect=True)
                    current_headers = self._strip_sensitive_headers(current_headers, current_url, location)
                    current_url = location
        raise RuntimeError(f"more than {max_redirects} redirects from {self._redact_url(url)}")

    @export
    async def flash_oci(self, reference: str, target: str | None = None) -> AsyncGenerator[dict[str, Any], None]:
        """Pull ``reference`` in the runtime and make it the disk; yields progress, then the result."""
        _check_target(target)
        ref = text(reference, "reference").removeprefix("oci://")
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
        resource = _resource(target)
        async with self._refusing(resource):
            _check_target(partition)
            await _check_handle(resource, None, "dump", self.resources, allow_local=self.parent.allow_local_urls)
        async with self.resource(target) as res:

            async def pump(client: RuntimeClient) -> None:
                async for chunk in client.dump_chunks():
                    await res.send(chunk)

            await self.parent.link.call(pump)

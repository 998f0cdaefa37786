"""Upload streams (upstream's ``ResourceStreamRequest``) a lease holder may open to a driver.

Upstream's ``Driver.Stream`` lets a client open an upload to *any* driver: it keeps the stream in
``driver.resources`` (32 messages of up to 4 MiB buffered: 128 MiB) until a call such as
``flash`` reads it, and never drops one no call reads. So a lease holder could pin 128 MiB of the
exporter per stream, as many times as they liked, until the lease's tree closed (security.md, row
51). Only the storage driver reads uploads: every other driver refuses them, and the storage
driver keeps at most :data:`MAX_OPEN_UPLOADS` open and drops each one whose client has left.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID

from grpc import StatusCode
from jumpstarter.common.resources import ClientStreamResource, ResourceMetadata
from jumpstarter.common.streams import ResourceStreamRequest

#: upload streams a storage driver holds at once (a flash reads one; a VM takes one transfer at a time)
MAX_OPEN_UPLOADS = 2


class RefusesUploads:
    """For a driver that reads no upload: a stream opened to upload to it is refused."""

    @contextlib.asynccontextmanager
    async def Stream(self, request: Any, context: Any) -> AsyncIterator[Any]:  # (upstream's name)
        if isinstance(request, ResourceStreamRequest):
            await context.abort(StatusCode.FAILED_PRECONDITION,
                                f"{type(self).__name__} reads no upload; send files to the storage driver "
                                "(j vm storage flash FILE)")
        async with super().Stream(request, context) as stream:  # type: ignore[misc]
            yield stream


class BoundedUploads:
    """For the storage driver: at most :data:`MAX_OPEN_UPLOADS` uploads open, and an upload whose
    client left before a call read it is dropped with its buffer."""

    resources: dict[UUID, Any]
    #: uploads a call is reading (the class's dataclass field)
    uploads_reading: set[UUID]

    @contextlib.asynccontextmanager
    async def Stream(self, request: Any, context: Any) -> AsyncIterator[Any]:  # (upstream's name)
        if not isinstance(request, ResourceStreamRequest):
            async with super().Stream(request, context) as stream:  # type: ignore[misc]
                yield stream
            return
        if len(self.resources) >= MAX_OPEN_UPLOADS:
            await context.abort(StatusCode.RESOURCE_EXHAUSTED,
                                f"{len(self.resources)} uploads are open to this driver already, the most it "
                                "holds; finish or close one first")
        async with super().Stream(request, context) as stream:  # type: ignore[misc]
            resource = ResourceMetadata.model_validate(stream.metadata).resource
            try:
                yield stream
            finally:
                if isinstance(resource, ClientStreamResource) and resource.uuid not in self.uploads_reading:
                    left = self.resources.pop(resource.uuid, None)
                    if left is not None:
                        with contextlib.suppress(Exception):
                            await left.aclose()

    @contextlib.asynccontextmanager
    async def _resource_from_client_stream(self, resource_uuid: UUID, content_encoding: Any) -> AsyncIterator[Any]:
        # a call reads it: the stream's end, which may come first (the client gone), must leave it be
        self.uploads_reading.add(resource_uuid)
        try:
            async with super()._resource_from_client_stream(  # type: ignore[misc]
                    resource_uuid, content_encoding) as stream:
                yield stream
        finally:
            self.uploads_reading.discard(resource_uuid)

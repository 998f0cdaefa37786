"""Attack: upload streams a lease holder opens and never hands to a call (docs/security.md, row 51).

Upstream's ``Driver.Stream`` takes an upload (``ResourceStreamRequest``) to any driver and keeps it,
with what it buffered (up to 32 messages of 4 MiB), in ``driver.resources`` until a call reads it:
an upload to ``vm.power`` was never read nor dropped. Opened and left, again and again, each held
its buffer in the exporter until the lease's tree closed: 128 MiB a stream (an auditor's repro:
RSS 280 → 415 → 533 MiB after three). The exporter's side runs here in-process (``serve``, as a
session does) over real gRPC; no runtime is needed, as no call is made.
"""

from __future__ import annotations

import os
import time
from typing import Any

import anyio
import pytest
from anyio.abc import ObjectStream
from pydantic import ValidationError

from jumpstarter_driver_vmsidecar.driver import VirtualMachine
from jumpstarter_driver_vmsidecar.uploads import MAX_OPEN_UPLOADS

pytestmark = pytest.mark.timeout(120)
CHUNK = 1 << 20


class _Endless(ObjectStream[bytes]):
    """An upload that sends ``chunks`` MiB, then waits."""

    def __init__(self, chunks: int) -> None:
        self.left = chunks

    async def receive(self) -> bytes:
        if self.left <= 0:
            await anyio.sleep(3600)
        self.left -= 1
        return os.urandom(CHUNK)

    async def send(self, item: bytes) -> None:
        pass

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


def _buffered(driver: Any) -> int:
    """Bytes a driver's open uploads hold."""
    return sum(len(item) for stream in driver.resources.values() for item in stream.receive_stream._state.buffer)


def test_uploads_no_call_reads_are_refused_or_dropped_with_their_buffers(tmp_path: Any) -> None:
    from jumpstarter.common.utils import serve

    vm = VirtualMachine(socket=str(tmp_path / "absent.sock"), spec={"gpio": [{"name": "led", "direction": "out"}],
                                                                          "can": [{"name": "can0"}]})

    with serve(vm) as client:
        # a driver that reads no upload refuses one
        for child in (client.power, client.console, client, client.gpio, client.gpio.led, client.can):

            async def upload(child: Any = child) -> None:
                with anyio.move_on_after(3):  # (an upload taken waits for a call: no refusal came)
                    async with child.resource_async(_Endless(4)):
                        await anyio.sleep(3600)
            # refused before the stream's metadata: the stock client says so in its own words
            with pytest.raises(ValidationError, match="ResourceMetadata"):
                client.portal.call(upload)
        assert not any(driver.resources for _, _, _, driver in vm.enumerate())

        # the storage driver: an upload its client left before a call read it is dropped
        storage = vm.children["storage"]

        async def left_open() -> None:
            with anyio.move_on_after(2):
                async with client.storage.resource_async(_Endless(24)):
                    await anyio.sleep(3600)
        for _ in range(3):
            client.portal.call(left_open)
        deadline = time.monotonic() + 5
        while storage.resources and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not storage.resources, f"{len(storage.resources)} left uploads kept {_buffered(storage) >> 20} MiB"

        # and holds at most MAX_OPEN_UPLOADS at once
        async def many_open() -> None:
            async with anyio.create_task_group() as group:
                for _ in range(MAX_OPEN_UPLOADS):
                    group.start_soon(left_open)
                await anyio.sleep(1)
                with pytest.raises(ValidationError, match="ResourceMetadata"):
                    async with client.storage.resource_async(_Endless(1)):
                        await anyio.sleep(1)
        client.portal.call(many_open)

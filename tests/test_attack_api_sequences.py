"""Attack: valid API calls in hostile sequences (a seventh reading, 2026-11-29; docs/security.md
rows 48-50). An API caller is a lease holder (controller/admission.py): each test is a lease that
does only what it may, in an order that carried something of it past its end, on the in-memory
hypervisor (tests/fixtures/fake_backend.py) behind the real API server.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from fixtures.fake_backend import Build, FakeVm, Images, fake_spec, until
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.state import Phase
from vmsidecar_runtime.api.server import make_app
from vmsidecar_runtime.hostpaths import HostPathPolicy

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def served(fake_vm: Build, fake_images: Images) -> AsyncIterator[tuple[FakeVm, Path]]:
    """A Ready VM on the fake hypervisor, its API on a socket; flashes of ``fake_images.other`` allowed."""
    fvm = await fake_vm(fake_spec(fake_images.base), host_paths=HostPathPolicy((fake_images.other.parent,)))
    runner = web.AppRunner(make_app(fvm.vm))
    await runner.setup()
    sock = Path(f"/tmp/vms-{os.getpid()}-{id(fvm)}.sock")
    await web.UnixSite(runner, str(sock)).start()
    try:
        yield fvm, sock
    finally:
        await runner.cleanup()
        sock.unlink(missing_ok=True)


async def test_an_event_stream_of_lease_n_ends_when_the_next_lease_claims(
        served: tuple[FakeVm, Path], fake_images: Images) -> None:
    """Lease N opened ``GET /v1/events`` with its generation and kept it: it read lease N+1's
    claim, boots, power calls and the references N+1 flashed (18 events)."""
    fvm, sock = served
    seen: list[dict] = []
    async with RuntimeClient(sock) as lease_n, RuntimeClient(sock) as lease_n1:
        lease_n.generation = (await lease_n.claim("lease-n-token")).generation
        await lease_n.power("on")
        await lease_n.wait_ready(10)

        async def listen() -> None:
            async for event in lease_n.events():
                seen.append(event)
        stream = asyncio.create_task(listen())
        await asyncio.sleep(0.2)
        lease_n1.generation = (await lease_n1.claim("lease-n1-token")).generation
        await until(fvm.vm, Phase.READY)
        await lease_n1.power("off", graceful=False)
        await lease_n1.flash_reference(f"file:{fake_images.other}")
        await lease_n1.power("on")
        await lease_n1.wait_ready(10)
        await asyncio.wait_for(stream, 5)  # the stream ended on its own
    assert seen and seen[0]["type"] == "hello"
    later = [e for e in seen if e["generation"] != lease_n.generation]
    assert not later, f"lease N's stream read {len(later)} events of lease N+1: {later[:3]}"


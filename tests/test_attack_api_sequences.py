"""Attack: valid API calls in hostile sequences (a seventh reading, 2026-11-29; docs/security.md
rows 48-50). An API caller is a lease holder (controller/admission.py): each test is a lease that
does only what it may, in an order that carried something of it past its end, on the in-memory
hypervisor (tests/fixtures/fake_backend.py) behind the real API server; a runtime restarted mid-lease
on real runtime processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp import web

from fixtures.fake_backend import (
    Build,
    FakeHypervisor,
    FakeVm,
    Images,
    ThreadServed,
    fake_spec,
    served_on_a_thread,
    until,
)
from fixtures.waiting import wait_until_async
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.errors import VmsidecarError
from vmsidecar_contract.process import RuntimeProcess, clean_environ
from vmsidecar_contract.spec import VmSpec, load_spec
from vmsidecar_contract.state import Phase
from vmsidecar_runtime.api.server import make_app
from vmsidecar_runtime.controller import pool_spec
from vmsidecar_runtime.hostpaths import HostPathPolicy

pytestmark = pytest.mark.timeout(60)
T = TypeVar("T")


@contextlib.asynccontextmanager
async def api_of(fvm: FakeVm) -> AsyncIterator[Path]:
    """The controller's API on a socket of its own, while the block runs."""
    runner = web.AppRunner(make_app(fvm.vm))
    await runner.setup()
    sock = Path(f"/tmp/vms-{os.getpid()}-{id(fvm)}.sock")
    await web.UnixSite(runner, str(sock)).start()
    try:
        yield sock
    finally:
        await runner.cleanup()
        sock.unlink(missing_ok=True)


@pytest.fixture
async def served(fake_vm: Build, fake_images: Images) -> AsyncIterator[tuple[FakeVm, Path]]:
    """A Ready VM on the fake hypervisor, its API on a socket; flashes of ``fake_images.other`` allowed."""
    fvm = await fake_vm(fake_spec(fake_images.base), host_paths=HostPathPolicy((fake_images.other.parent,)))
    async with api_of(fvm) as sock:
        yield fvm, sock


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



async def _dump_read_short_of_the_end(sock: Path, keep: int) -> tuple[bytes, socket.socket]:
    """``GET /v1/vm/disk?format=raw`` on a raw socket, its body read but for its last ``keep``
    bytes (small buffers: the runtime's last write waits); the socket stays open. The status line,
    and the socket."""
    reader = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(reader, str(sock))
    await loop.sock_sendall(reader, b"GET /v1/vm/disk?format=raw HTTP/1.1\r\nHost: runtime\r\n\r\n")
    got = b""
    while b"\r\n\r\n" not in got:
        got += await loop.sock_recv(reader, 4096)
    head, body = got.split(b"\r\n\r\n", 1)
    status = head.split(b"\r\n")[0]
    length = int(re.search(rb"(?im)^content-length: *([0-9]+)", head).group(1)) if b" 200 " in status else 0
    read = len(body)
    while read < length - keep:
        read += len(await loop.sock_recv(reader, min(65536, length - keep - read)))
    return status, reader


async def test_a_dump_read_to_its_last_chunk_holds_the_transfer_until_the_lease_ends(
        served: tuple[FakeVm, Path]) -> None:
    """A dump read to its last MiB and left there freed the VM's one transfer while its full-size
    copy stayed in the state volume: dump after dump, five copies, none removed by the next claim
    (the volume filled for the next lease's guest). The transfer must stay held, and the next claim
    must cut the dump and remove its copy."""
    fvm, sock = served
    readers: list[socket.socket] = []
    try:
        async with RuntimeClient(sock) as lease_n:
            await lease_n.power("off", graceful=False)
            status, reader = await _dump_read_short_of_the_end(sock, 1 << 20)
            readers.append(reader)
            assert b" 200 " in status, status
            await asyncio.sleep(0.3)
            for _ in range(3):  # the lease asks again while its reader waits
                status, reader = await _dump_read_short_of_the_end(sock, 1 << 20)
                readers.append(reader)
                assert b" 409 " in status, f"a second dump began while the first one's copy stays: {status!r}"
            assert len(list(fvm.paths.state.glob("dump-*"))) == 1
            await lease_n.claim("lease-n1-token")  # the next lease
        await wait_until_async(lambda: not list(fvm.paths.state.glob("dump-*")), 5,
                               "the cut dump's copy to be removed")
    finally:
        for reader in readers:
            reader.close()


def _leased_tree(served: ThreadServed, spec: VmSpec | None = None, lease: str = "lease N") -> Any:
    """A driver tree (InPlaceReuse) the exporter hands a lease, its claim made; ``spec``: its config's."""
    from jumpstarter_driver_vmsidecar.driver import VirtualMachine

    tree = VirtualMachine(socket=str(served.socket), recycle="InPlaceReuse",
                          **({"spec": spec.to_json()} if spec is not None else {}))
    tree.reset()
    assert tree.link.claimed_generation == served.fvm.vm.generation, f"{lease} was not claimed"
    return tree


def _as_lease(served: ThreadServed, tree: Any, act: Callable[[RuntimeClient], Awaitable[T]]) -> T:
    """``act`` with an API client bound to ``tree``'s lease (a lease holder with the API socket)."""
    async def acting() -> T:
        async with RuntimeClient(served.socket) as client:
            client.generation = tree.link.claimed_generation
            return await act(client)
    return served.run(acting())


async def _boot_a_spec_of_its_own(spec: VmSpec, client: RuntimeClient) -> None:
    await client.power("off", graceful=False)
    await client.put_spec(spec)
    await client.power("on")
    await client.wait_ready(10)


def test_a_spec_lease_n_sets_is_gone_at_the_next_claim_and_never_wedges_it(
        fake_images: Images, tmp_path: Path) -> None:
    """Lease N powered off, set a spec of its own (any field its admission allows: here the memory)
    and booted it. Its recycle kept that spec; the next tree's claim sent the pool's spec first,
    which the runtime refused while the guest ran (409 wrong_phase): that lease and every later one
    was served unclaimed (every call: "cannot replace the spec while the VM is Ready"), never
    recycled, on lease N's spec. The pool's spec must be back for the next lease, claimed."""
    pool = fake_spec(fake_images.base)
    with served_on_a_thread(tmp_path / "vm", pool, FakeHypervisor()) as served:
        vm = served.fvm.vm
        tree_n = _leased_tree(served, pool)
        _as_lease(served, tree_n, functools.partial(_boot_a_spec_of_its_own, pool.model_copy(update={"memory": 512})))
        tree_n.close()  # its recycle boots the pool's spec, not lease N's
        assert vm.spec == pool and not vm.state().claimed, vm.spec
        for lease in (1, 2):
            tree = _leased_tree(served, pool, f"lease N+{lease}")
            assert vm.spec == pool, f"lease N+{lease} runs lease N's spec (memory {vm.spec and vm.spec.memory})"
            served.run(until(vm, Phase.READY))
            tree.close()


def test_a_spec_lease_n_sets_is_gone_for_an_exporter_that_names_none(fake_images: Images, tmp_path: Path) -> None:
    """Row 50's exporter with no spec of its own (the runtime's ``--spec`` is the pool's): lease N
    set its own spec over the API and booted it; its recycle and the next tree's claim kept it, so
    lease N+1 was served lease N's spec (here its memory; any field the API admits, the image too).
    The runtime's own spec must be back for the next lease, as an exporter's spec is."""
    own = fake_spec(fake_images.base)
    with served_on_a_thread(tmp_path / "vm", own, FakeHypervisor()) as served:
        vm = served.fvm.vm
        tree_n = _leased_tree(served)
        _as_lease(served, tree_n, functools.partial(_boot_a_spec_of_its_own, own.model_copy(update={"memory": 512})))
        assert vm.spec is not None and vm.spec.memory == 512
        tree_n.close()  # its recycle boots the runtime's spec, not lease N's
        assert vm.spec == own, f"lease N's recycle kept its spec (memory {vm.spec and vm.spec.memory})"
        tree = _leased_tree(served, lease="lease N+1")
        assert vm.spec == own, f"lease N+1 runs lease N's spec (memory {vm.spec and vm.spec.memory})"
        served.run(until(vm, Phase.READY))
        tree.close()


def test_a_spec_lease_n_sets_is_dropped_when_neither_the_runtime_nor_the_exporter_names_one(
        fake_images: Images, tmp_path: Path) -> None:
    """A pool whose runtime and exporter name no spec (each lease sets its own): lease N's spec, its
    image and the disk it pulled were lease N+1's VM, which lease N+1 boots with ``power on``
    unless it sets another. The next lease must find no spec (nothing to boot, the phase Stopped)."""
    allowed = HostPathPolicy((fake_images.base.parent,))  # the lease's image, as an administrator may allow
    with served_on_a_thread(tmp_path / "vm", None, FakeHypervisor(), host_paths=allowed) as served:
        vm = served.fvm.vm
        tree_n = _leased_tree(served)

        async def lease_n_sets_a_spec(client: RuntimeClient) -> None:
            await client.put_spec(fake_spec(fake_images.base))
            await client.wait_ready(10)  # a spec with an image boots at once in a pod without one
        _as_lease(served, tree_n, lease_n_sets_a_spec)
        tree_n.close()
        tree = _leased_tree(served, lease="lease N+1")
        state = vm.state()
        assert vm.spec is None and state.image is None and state.image_digest is None, (vm.spec, state)
        assert state.phase == Phase.STOPPED, state.phase

        async def lease_n1_powers_on(client: RuntimeClient) -> str:
            with pytest.raises(VmsidecarError) as refused:
                await client.power("on")
            return refused.value.message
        assert "no VM spec" in _as_lease(served, tree, lease_n1_powers_on)
        tree.close()


async def test_a_lease_never_brings_a_snapshot_source_of_its_own(fake_vm: Build) -> None:
    """Row 40: with the API socket (a lease holder's), ``PUT`` a spec whose ``snapshot_source`` is a
    repository of one's own (or claim with one) before a boot on a key the cache has no snapshot of:
    the runtime restored what that repository publishes under the pool's key and stored it in the
    cache, the next leases' guest (and every pod's on that cache). Only the source the pool's
    configuration names is read: the runtime's own spec, or the spec it was given before any lease."""
    pool = fake_spec(None, snapshot="auto", snapshot_source="registry.pool.example/snapshots")  # (no image: no boot)
    evil = "registry.evil.example/snapshots"
    fvm = await fake_vm(None)
    vm = fvm.vm
    async with api_of(fvm) as socket:
        async with RuntimeClient(socket) as exporter:
            await exporter.put_spec(pool)  # the exporter's start-up tree: before any lease, the pool's
            lease_n = RuntimeClient(socket)
            lease_n.generation = (await exporter.claim(token="lease-n-token", spec=pool)).generation
            async with lease_n:
                await lease_n.power("off", graceful=False)
                with pytest.raises(VmsidecarError) as put:
                    await lease_n.put_spec(pool.model_copy(update={"snapshot_source": evil}))
                with pytest.raises(VmsidecarError) as claimed:
                    await lease_n.claim(token="lease-n-again", spec=pool.model_copy(update={"snapshot_source": evil}))
                # the pool's own source, or none, a lease's spec may keep
                await lease_n.put_spec(pool.model_copy(update={"memory": 512}))
                await lease_n.put_spec(pool.model_copy(update={"snapshot_source": None}))
        for refused_ in (put.value, claimed.value):
            assert refused_.code == "invalid_spec" and evil in refused_.message, refused_
            assert "registry.pool.example/snapshots" in refused_.message and "--spec" in refused_.message
        assert vm.spec is not None and vm.spec.snapshot_source is None


async def test_a_restarted_runtime_keeps_the_pools_snapshot_source(tmp_path: Path) -> None:
    """Row 40, a runtime restarted mid-lease (real runtime processes; no image: nothing boots): the
    runtime is killed while a lease holds its pod (an OOM, a crash) and its container starts it
    again with no ``--spec`` of its own, as a pool pod's runtime is started. Before the exporter's
    tree claims again, the lease holder with the API socket ``PUT``s (or claims with) a spec naming
    a source of its own: the restarted runtime took it as the pool's. The runtime remembers the
    pool's spec in its state directory."""
    pool = load_spec({"memory": "256M", "snapshot": "auto", "snapshot_source": "registry.pool.example/snapshots"})
    evil = pool.model_copy(update={"snapshot_source": "registry.evil.example/snapshots"})
    start = functools.partial(RuntimeProcess.start, tmp_path / "rt", cache=tmp_path / "cache",
                              env=clean_environ(), args=["--grace", "5"])
    with start() as first:
        await first.wait_serving()
        async with RuntimeClient(first.socket) as exporter:
            await exporter.put_spec(pool)  # the exporter's start-up tree: before any lease, the pool's
            await exporter.claim(token="lease-n-token", spec=pool)
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    with start() as again:
        await again.wait_serving()
        async with RuntimeClient(again.socket) as lease_n:
            with pytest.raises(VmsidecarError) as put:
                await lease_n.put_spec(evil)
            with pytest.raises(VmsidecarError) as claimed:
                await lease_n.claim(token="lease-n-again", spec=evil)
            # the exporter's tree claims again (an exporter whose config names no spec: the runtime's
            # own is served, the pool's); the pool's source, or none, a lease's spec may keep
            await lease_n.claim(token="lease-n-tree")
            assert await lease_n.get_spec() == pool
            await lease_n.put_spec(pool.model_copy(update={"snapshot_source": None}))
            await lease_n.claim(token="lease-n-tree-again", spec=pool)
        assert (again.state / pool_spec.FILE_NAME).is_file()
        assert again.stop() == 0
    for refused_ in (put.value, claimed.value):
        assert refused_.code == "invalid_spec" and "registry.evil.example" in refused_.message, refused_
        assert "registry.pool.example/snapshots" in refused_.message, refused_
    # stopped cleanly, it is not mid-lease: the next runtime on the directory (a pool configured
    # anew, a developer's next session) takes the spec it is given before any lease
    assert not (again.state / pool_spec.FILE_NAME).exists()
    next_pool = pool.model_copy(update={"snapshot_source": "registry.next-pool.example/snapshots"})
    with start() as third:
        await third.wait_serving()
        async with RuntimeClient(third.socket) as administrator:
            await administrator.put_spec(next_pool)
            await administrator.claim(token="next-pool", spec=next_pool)
        assert third.stop() == 0


@pytest.mark.parametrize("left", [b"not json", b"[]", b"null", b'{"memory": "lots"}', b" " * (2 << 20), None])
def test_a_pool_spec_left_unreadable_is_not_held(tmp_path: Path, left: bytes | None) -> None:
    """What a killed runtime left that is not a spec (a disk error, a full volume: the file is only
    ever the runtime's own) is not held to, nor is a link; a spec is."""
    path = tmp_path / pool_spec.FILE_NAME
    if left is None:
        (tmp_path / "elsewhere.json").write_text(json.dumps(fake_spec(None).to_json()))
        path.symlink_to(tmp_path / "elsewhere.json")
    else:
        path.write_bytes(left)
    assert pool_spec.remembered(tmp_path) is None
    path.unlink()
    pool_spec.remember(tmp_path, fake_spec(None, snapshot_source="registry.pool.example/snapshots"))
    held = pool_spec.remembered(tmp_path)
    assert held is not None and held.snapshot_source == "registry.pool.example/snapshots"
    assert oct(path.stat().st_mode & 0o777) == "0o600" and not list(tmp_path.glob(".*")), list(tmp_path.iterdir())

"""Races found by reading the code, each produced for real: a forward's port taken between its
choice and QEMU's bind; a wait for Ready on a VM nothing will boot; concurrent dumps."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

from vmsidecar_contract.errors import GuestError
from vmsidecar_contract.spec import load_spec
from vmsidecar_runtime import ports
from vmsidecar_runtime.controller import RuntimePaths, VmController

pytestmark = pytest.mark.timeout(600)


async def test_a_forward_port_taken_before_qemu_binds_it_is_retried(
    tiny_image: Any, tmp_path: Path, image_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    thief = socket.socket()
    thief.bind(("127.0.0.1", 0))
    thief.listen()
    stolen = thief.getsockname()[1]
    picks = iter([stolen])
    real = ports._free_port
    # the one seam: the first "free" port handed out is one another process holds by the time QEMU binds
    monkeypatch.setattr(ports, "_free_port", lambda address: next(picks, None) or real(address))
    spec = load_spec({"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off",
                      "network": {"forwards": [{"name": "web", "guest_port": 80}]}})
    paths = RuntimePaths(tmp_path / "shared", image_cache, tmp_path / "state", Path(f"/tmp/vmsidecar-race-{id(tmp_path)}"))
    vm = VmController(spec, paths)
    await vm.start(boot=False)
    try:
        state = await vm.power_on()
        assert state.phase.value == "Running" and state.forwards["web"] != f"127.0.0.1:{stolen}"
    finally:
        await vm.close()
        thief.close()


async def test_wait_ready_gives_up_on_a_vm_that_stays_stopped(start_runtime: Any, tiny_image: Any) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    client = rt.client()
    await client.wait_ready(240)
    await client.power("off", graceful=False)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(GuestError, match="nothing is booting it; power it on"):
        await client.wait_ready(120)
    assert loop.time() - started < 30


async def test_concurrent_dumps_do_not_share_a_file(start_runtime: Any, tiny_image: Any, tmp_path: Path) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    client = rt.client()
    await client.wait_ready(240)
    await client.power("off", graceful=False)
    outs = [tmp_path / f"dump{i}.qcow2" for i in range(4)]
    sizes = await asyncio.gather(*(rt.client().dump(out) for out in outs))
    digests = {out.read_bytes()[:4096] for out in outs}
    assert all(size > 0 for size in sizes) and len(digests) == 1  # four whole, identical copies
    assert not list(rt.state.glob("dump-*")), "a dump file was left behind"

"""The guest clock after a memory-snapshot restore: a restored guest resumes at the capture
instant; with a guest agent the runtime sets its clock to the host's before Ready, without one it
says so (and the restore stays as fast). The Debian guest's clock, set through its agent, is checked
on the boot of ``test_debian_guest.py`` (one Debian boot for both)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fixtures.runtime import recycle_until_ready
from vmsidecar_images.console import Console
from vmsidecar_runtime.plan import GUEST_AGENT_PORT

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def image_cache(tmp_path: Path) -> Path:
    """A cache of this test's own (overrides the session's, which every xdist worker shares): these
    tests read, compare or damage the cache's entries, and another worker's captures would be among them."""
    return tmp_path / "cache"


async def test_a_guest_without_agent_restores_as_fast_and_says_so(start_runtime: Any, tiny_image: Any,
                                                                  image_cache: Path) -> None:
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "channels": [{"name": "clock-tiny"}]}
    rt = await start_runtime(spec)
    client = rt.client()
    await client.wait_ready(240)
    first = await client.wait_stored()
    assert first.snapshot.boot == "cold" and first.snapshot.available, first.snapshot
    assert first.snapshot.clock == "no guest agent", first.snapshot
    state, seconds = await recycle_until_ready(client)
    assert state.snapshot.boot == "restored" and state.snapshot.clock == "no guest agent", state.snapshot
    assert seconds < 10, f"a restore took {seconds:.1f} s"  # ~0.15 s unloaded: no agent, no wait

    # a snapshot without the capture's findings (an older layout) is not used: a cold boot, with
    # the reason, captures a complete one
    metas = [p / "meta.json" for p in (image_cache / "snapshots").iterdir() if (p / "meta.json").is_file()]
    newest = max(metas, key=lambda p: p.stat().st_mtime)
    newest.unlink()
    state, _ = await recycle_until_ready(client)
    assert state.snapshot.boot == "cold" and "captures one" in (state.snapshot.reason or ""), state.snapshot
    stored = (await client.wait_stored()).snapshot  # Ready comes first; the capture once the guest settled
    assert stored.available and stored.clock == "no guest agent", stored  # the captured boot goes on
    assert newest.is_file(), "the cold boot captured the snapshot again"
    state, _ = await recycle_until_ready(client)
    assert state.snapshot.boot == "restored" and state.snapshot.clock == "no guest agent", state.snapshot


async def test_a_guest_agent_answering_with_json_nested_past_the_parser_is_no_clock_and_still_ready(
        start_runtime: Any, tiny_image: Any, image_cache: Path) -> None:
    """A hostile image's "agent": a program in the guest holding the agent's port and writing lines of a
    million ``[`` (under the session's 1 MiB line bound), which Python's JSON parser cannot nest and
    answers with a ``RecursionError``, not a ``ValueError``. The restore sets no clock, says why (in
    the claim's answer, which waits for the clock), and the guest is Ready all the same, restore
    after restore."""
    marker = "HOSTILE-AGENT-UP"
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "channels": [{"name": "clock-hostile"}],
            "readiness": {"pattern": marker}}
    rt = await start_runtime(spec)
    con = await Console.open_when_served(rt.shared / "console.sock")
    await con.wake()
    port = (await con.run(f"grep -l '^{GUEST_AGENT_PORT}$' /sys/class/virtio-ports/*/name")).strip()
    assert port, "the tiny guest has no guest-agent port"
    # the port held open (the capture records an agent), a line of nesting written to it again and again
    con.writer.write(f"head -c 1000000 /dev/zero | tr '\\0' '[' > /tmp/nest; echo >> /tmp/nest; "
                     f"exec 3<>/dev/$(basename $(dirname {port})); "
                     f"(while :; do cat /tmp/nest >&3; done) & echo {marker[:7]}''{marker[7:]}\n".encode())
    await con.writer.drain()
    await con.close()
    client = rt.client()
    await client.wait_ready(240)
    first = await client.wait_stored()
    assert first.snapshot.available and first.snapshot.boot == "cold", first.snapshot
    for _ in range(2):
        state, _ = await recycle_until_ready(client)
        assert state.snapshot.boot == "restored", state.snapshot
        state = await client.claim()  # answered once the clock's outcome is known (Ready comes first)
        assert (state.snapshot.clock or "").startswith("failed:"), state.snapshot
        assert "agent" in state.snapshot.clock, state.snapshot.clock
    assert (await client.state()).phase.value == "Ready"


async def test_a_guest_agents_error_is_said_bounded_and_on_one_line(tmp_path: Path) -> None:
    """A hostile image's agent answers ``guest-set-time`` with an error whose ``desc`` is 60 KB with
    newlines: it went verbatim into ``snapshot.clock`` (every ``GET /v1/vm`` of that boot) and into a
    log line of its own making ("\\n2099-01-01 INFO fake")."""
    import asyncio
    import json

    from vmsidecar_runtime.backend.guest_agent import GuestAgent
    from vmsidecar_runtime.controller.guest_clock import correct_clock

    async def agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            sync = json.loads(line.lstrip(b"\xff"))["arguments"]["id"]
            command = json.loads(await reader.readline())
            desc = "\n2099-01-01 INFO vmsidecar: a line the guest wrote\n" + "A" * 60_000
            error = {"id": command["id"], "error": {"class": "x", "desc": desc}}
            writer.write(b"\xff" + json.dumps({"return": sync}).encode() + b"\n")
            writer.write(json.dumps(error).encode() + b"\n")
            await writer.drain()

    socket = tmp_path / "qga.sock"
    server = await asyncio.start_unix_server(agent, path=str(socket))
    session = await GuestAgent.connect(socket)
    try:
        clock = await correct_clock(True, session)
    finally:
        await session.close()
        server.close()
    assert clock.startswith("failed: guest-set-time: "), clock[:200]
    assert "\n" not in clock and len(clock) < 400, clock[:400]

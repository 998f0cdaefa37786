"""Attack: a readiness regex that backtracks, fed by the guest's console (issue 19, item 5).

A pattern such as ``(a|aa)+b`` comes from the spec or an image annotation; the guest prints ``a``
without end. On a backtracking engine every console chunk costs exponential time on the event
loop, and the API, recycle and signals stop. The runtime runs readiness on RE2 (linear time) and
refuses what RE2 cannot run (backreferences, lookarounds) when the spec or the annotation is read.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from pathlib import Path
from typing import Any

import pytest

from fixtures.attack import max_state_latency
from vmsidecar_contract.errors import ImageError, SpecError
from vmsidecar_contract.spec import (
    DEFAULT_READY_PATTERN,
    READINESS_ANNOTATIONS,
    VmSpec,
    compile_readiness_pattern,
    load_spec,
)
from vmsidecar_images.console import Console
from vmsidecar_runtime.disk import DiskImage
from vmsidecar_runtime.readiness_rules import effective_readiness

pytestmark = pytest.mark.timeout(300)

#: exponential on a backtracking engine: each extra ``q`` doubles the work of a failed search. Not
#: ``(a|aa)+b``: the guest's boot line carries a random boot id in hex, and one in nine holds "ab"
#: (the guest became Ready on it in a CI run: a flaky test, not a broken runtime)
EVIL = "(q|qq)+z"


def _many_counted_repeats() -> str:
    """A pattern within the spec's 1024 characters that RE2 runs in linear time, but slowly: counted
    repeats in 100+ alternatives (``0.{899}|1.{899}|…|00.{898}|…``) before a NUL the guest never
    prints. Their states overflow RE2's DFA cache, which falls back to its NFA: ~18 µs a byte of
    varied text on this host, a second per 64 KiB console chunk (the default pattern: 0.002 µs)."""
    alts: list[str] = []
    for prefix in ("".join(p) for k in range(3) for p in itertools.product("0123456789abcdef", repeat=k)):
        pattern = "(?s)(" + "|".join([*alts, f"{prefix}.{{{900 - len(prefix)}}}"]) + r")\x00"
        if len(pattern) > 1024:
            break
        alts.append(f"{prefix}.{{{900 - len(prefix)}}}")
    return "(?s)(" + "|".join(alts) + r")\x00"


#: linear for RE2, slow all the same (the watch's own test below; a guest under TCG prints too slowly
#: for it to show through the API)
SLOW = _many_counted_repeats()


async def test_backtracking_pattern_on_a_flooding_console_keeps_the_api_answering(
    start_runtime: Any, tiny_image: Any, record_property: Any
) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off",
                              "readiness": {"pattern": EVIL, "timeout": 240}})
    client = rt.client()
    con = await Console.open_when_served(rt.shared / "console.sock")
    await con.wake()
    # the guest's shell prints an endless run of "q" (never a "z") on ttyS0, the readiness console;
    # the command line itself has no run of "q" (its echo would already be the attack)
    con.writer.write(b"x=q; while :; do printf $x$x$x$x$x$x$x$x$x$x$x$x$x$x$x$x; done &\n")
    await con.writer.drain()
    await con.expect(b"q{4000}", 30)  # the flood is real: thousands of "q" went through the watcher
    try:
        worst = await max_state_latency(client, 4)
    except AssertionError:
        rt.proc.kill()  # its loop is stuck: SIGTERM would wait for the fixture's whole grace
        raise
    record_property("api_latency_max_s", round(worst, 3))
    print(f"readiness {EVIL!r} on a console printing 'q' without end: API latency max {worst:.3f} s")
    state = await client.state()
    assert state.phase.value == "Running", state  # still waiting for a "z", not broken
    await con.close()


@pytest.mark.parametrize("pattern", [r"(a)\1", r"login(?=: )", r"(?<!dracut)# ", r"(?>a+)b"])
def test_a_pattern_re2_cannot_run_is_refused_in_the_spec(pattern: str) -> None:
    with pytest.raises(SpecError) as caught:
        load_spec({"readiness": {"pattern": pattern}})
    message = str(caught.value)
    assert repr(pattern) in message and "RE2 syntax" in message, message


def test_a_pattern_re2_cannot_run_is_refused_in_an_image_annotation() -> None:
    disk = DiskImage(Path("/nonexistent"), "qcow2", "sha256:" + "0" * 64, "oci://registry.example/evil:1",
                     {READINESS_ANNOTATIONS["pattern"]: r"(x+)\1"})
    with pytest.raises(ImageError) as caught:
        effective_readiness(VmSpec(), disk)
    message = str(caught.value)
    assert repr(r"(x+)\1") in message and "RE2 syntax" in message and caught.value.code == "bad_readiness", message


def test_the_default_pattern_is_re2() -> None:
    assert compile_readiness_pattern(DEFAULT_READY_PATTERN).search(b"debian login: ")


async def test_a_slow_pattern_does_not_hold_the_runtimes_loop_behind_the_console(tmp_path: Path) -> None:
    """The watch itself, on a real hub draining a socket that stands in for QEMU's serial chardev:
    the guest's varied text in 64 KiB writes, the pattern of counted repeats. The loop's longest gap
    (a ticker) is what the API, recycle and signals would wait."""
    from vmsidecar_runtime.console import ConsoleHub
    from vmsidecar_runtime.controller.readiness import ReadinessWatch

    text = b"".join(b" " + os.urandom(16).hex(" ").encode() + b"\r\n" for _ in range(6000))[:4 * 65536]
    sent = asyncio.Event()

    async def guest(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for at in range(0, len(text), 65536):
            writer.write(text[at:at + 65536])
            await writer.drain()
        sent.set()
        await asyncio.sleep(30)

    chardev = tmp_path / "serial.sock"
    server = await asyncio.start_unix_server(guest, path=str(chardev))
    hub = ConsoleHub("ttyS0", tmp_path / "console.sock")
    errors: list[object] = []
    watch = ReadinessWatch(lambda: errors.append("ready"), errors.append)
    spec = VmSpec.model_validate({"readiness": {"pattern": SLOW, "timeout": 60}})
    watch.arm(spec, {"ttyS0": hub})
    loop = asyncio.get_running_loop()
    worst, last = 0.0, loop.time()
    try:
        await hub.attach(chardev)
        t0 = loop.time()
        while not sent.is_set() or loop.time() < t0 + 1:
            await asyncio.sleep(0.005)
            worst, last = max(worst, loop.time() - last), loop.time()
            assert loop.time() < t0 + 30, "the stand-in could not write its text"
    finally:
        watch.disarm()
        await hub.detach()
        server.close()
    print(f"a slow readiness pattern on 256 KiB of console text: the loop's longest gap {worst:.3f} s")
    # the search on the loop held it 4.7 s here (all 256 KiB in one search); off it, 0.006 s alone and
    # 0.33 s once in a full suite run (both cores busy: the loop's thread waited for a core, not for us)
    assert worst < 1.0, f"the loop was held {worst:.2f} s at once by the readiness search"
    assert errors == [], errors

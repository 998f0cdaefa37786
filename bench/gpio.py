"""GPIO latency benchmark: where the host ↔ guest round trip goes, leg by leg.

    uv run python bench/gpio.py [--runs 10] [--image file:PATH]

Boots one guest with two lines (``button``: host drives; ``led``: guest drives) and measures:

- host legs: a ``set`` on ``gpio.sock`` (the reply is written after the model has completed the
  armed event buffer and written the call eventfd, so this bounds host write → event-queue
  notification), and an API ``state`` call (what every driver call does first, to claim the lease);
- guest legs, inside the guest with busybox ``time`` over loops (process start-up of a static
  busybox applet and of the dynamically linked libgpiod tools; one sysfs write = one SET_VALUE);
- round trips on the raw protocol (no Jumpstarter): host ``set`` → guest ``gpiomon`` wakes → guest
  drives ``led`` → host ``wait`` reply; ``gpiomon`` is started (and armed) before the edge, then the
  guest answers with a new ``gpioset`` process (as ``tests/test_gpio.py`` does) or with a shell
  builtin writing the sysfs value (no process start after the edge);
- single calls and the builtin round trip through Jumpstarter's clients (``serve``).

Prints one line per measurement (median, min-max, in ms).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.process import RuntimeProcess
from vmsidecar_images.console import Console

LINES = [{"name": "button", "direction": "in"}, {"name": "led", "direction": "out"}]
LOOPS = 20  # guest-side loop length: busybox time has 10 ms resolution
BUILTIN_LOOPS = 400
#: the guest output line, exported through sysfs (named after the line: the chip names its lines)
LED = "/sys/class/gpio/led"
#: how the guest drives led (high, low): a libgpiod process, or a shell builtin on sysfs
TOOL = ("gpioset gpiochip0 1=1", "gpioset gpiochip0 1=0")
BUILTIN = (f"echo 1 > {LED}/value", f"echo 0 > {LED}/value")


def report(name: str, samples_ms: list[float]) -> None:
    """One result line."""
    print(f"{name:58s} median {statistics.median(samples_ms):7.2f} ms  "
          f"({min(samples_ms):.2f}-{max(samples_ms):.2f}, n={len(samples_ms)})", flush=True)


async def request(path: Path, *reqs: dict[str, Any]) -> list[dict[str, Any]]:
    """Send requests on one new gpio.sock connection; the replies."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        replies = []
        for req in reqs:
            writer.write(json.dumps(req).encode() + b"\n")
            await writer.drain()
            replies.append(json.loads(await reader.readline()))
        return replies
    finally:
        writer.close()


async def timed(fn: Callable[[], Awaitable[Any]], runs: int) -> list[float]:
    """Milliseconds of ``runs`` sequential calls."""
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def round_trip(gpio: Path, edge: str, value: int) -> float:
    """ms from the host's ``set button`` to the reply of a ``wait led <edge>`` armed before it."""
    reader, writer = await asyncio.open_unix_connection(str(gpio))
    writer.write(json.dumps({"op": "wait", "line": "led", "for": edge, "timeout": 10}).encode() + b"\n")
    await writer.drain()
    await asyncio.sleep(0.05)  # the wait is registered
    t0 = time.perf_counter()
    await request(gpio, {"op": "set", "line": "button", "value": value})
    reply = json.loads(await reader.readline())
    elapsed = (time.perf_counter() - t0) * 1000
    writer.close()
    assert reply.get("ok"), reply
    return elapsed


async def guest_loop_ms(con: Console, command: str, loops: int = LOOPS) -> float:
    """Per-iteration ms of ``command`` in the guest, from busybox ``time`` over ``loops`` iterations."""
    out = await con.run(f"time sh -c 'i=0; while [ $i -lt {loops} ]; do {command}; i=$((i+1)); done' 2>&1", 120)
    m = re.search(r"real\s+(?:(\d+)m\s*)?([\d.]+)s", out)
    assert m, out
    return (int(m.group(1) or 0) * 60 + float(m.group(2))) * 1000 / loops


async def guest_legs(con: Console, runs: int) -> None:
    """Process start-up and single GPIO requests, measured inside the guest."""
    empty = [await guest_loop_ms(con, ":") for _ in range(3)]
    report("guest: empty loop iteration (subtracted below)", empty)
    base = statistics.median(empty)
    legs = [
        ("guest: /bin/true (static busybox exec)", "/bin/true"),
        ("guest: gpioset --help (libgpiod tool start only)", "gpioset --help >/dev/null"),
        ("guest: gpioget gpiochip0 0 (start + chip + 1 line)", "gpioget gpiochip0 0 >/dev/null"),
        ("guest: gpioset gpiochip0 1=1 (start + chip + 1 line)", "gpioset gpiochip0 1=1"),
    ]
    for label, command in legs:
        report(label, [await guest_loop_ms(con, command) - base for _ in range(max(3, runs // 3))])
    await con.run("gpioset gpiochip0 1=0")
    # sysfs with shell builtins: one virtqueue request per iteration, no process; more loops,
    # since one iteration is well under busybox time's 10 ms resolution
    await export_led(con)
    empty = [await guest_loop_ms(con, ":", BUILTIN_LOOPS) for _ in range(3)]
    report(f"guest: empty loop iteration, {BUILTIN_LOOPS} loops (subtracted below)", empty)
    base = statistics.median(empty)
    for label, command in [("guest: sysfs write led (1 SET_VALUE, builtin)", f"echo 1 > {LED}/value"),
                           ("guest: sysfs read led (1 GET_VALUE, builtin)", f"read v < {LED}/value")]:
        report(label, [await guest_loop_ms(con, command, BUILTIN_LOOPS) - base for _ in range(max(3, runs // 3))])
    await con.run(f"echo 0 > {LED}/value; echo $(($(cat /sys/class/gpio/gpiochip*/base) + 1)) > /sys/class/gpio/unexport")


async def export_led(con: Console) -> None:
    """Export ``led`` through sysfs (so a shell builtin can drive it), driven low."""
    await con.run("echo $(($(cat /sys/class/gpio/gpiochip*/base) + 1)) > /sys/class/gpio/export")
    await con.run(f"echo low > {LED}/direction")


async def guest_round_trips(gpio: Path, con: Console, responder: tuple[str, str], runs: int,
                            host: Callable[[], Awaitable[float]]) -> list[float]:
    """Round trips; ``responder`` is (drive ``led`` high, drive it low), the first run once the guest's
    gpiomon saw the host's rising edge."""
    high, low = responder
    samples = []
    for _ in range(runs):
        await request(gpio, {"op": "set", "line": "button", "value": 0})
        await con.run(low)
        con.writer.write(f"gpiomon -n 1 -s -r gpiochip0 0 >/dev/null && {high}\n".encode())
        await con.writer.drain()
        await asyncio.sleep(1.0)  # gpiomon started and armed its event buffer
        try:
            samples.append(await host())
        except AssertionError as e:
            with contextlib.suppress(TimeoutError):
                await con.expect(rb"vm# ", 2)
            raise AssertionError(f"{e}; guest console: {bytes(con.seen[-400:])!r}") from None
    return samples


async def measure(rt: RuntimeProcess, spec: dict[str, Any], runs: int) -> None:
    """Every measurement, on a booted guest."""
    await rt.wait_ready(300, poll=0.05)
    shared = rt.shared
    gpio = shared / "gpio.sock"
    async with RuntimeClient(rt.socket) as client:
        report("host: API state call (over api.sock)", await timed(client.state, runs * 3))
    report("host: gpio.sock set (connect + JSON + model + eventq)",
           await timed(lambda: request(gpio, {"op": "set", "line": "button", "value": 0}), runs * 3))
    con = await Console.open(shared / "console.sock")
    await con.wake()
    await guest_legs(con, runs)

    def raw() -> Awaitable[float]:
        return round_trip(gpio, "rising", 1)

    tool = await guest_round_trips(gpio, con, TOOL, runs, raw)
    report("round trip, raw: gpiomon wakes, then gpioset process", tool)
    await export_led(con)
    builtin = await guest_round_trips(gpio, con, BUILTIN, runs, raw)
    report("round trip, raw: gpiomon wakes, then sysfs builtin", builtin)

    from jumpstarter.common.utils import serve

    from jumpstarter_driver_vmsidecar.driver import VirtualMachine

    serving = serve(VirtualMachine(socket=str(shared / "api.sock"), spec=spec, recycle="InPlaceReuse"))
    driver_client = await asyncio.to_thread(serving.__enter__)
    try:
        button, led = driver_client.gpio.children["button"], driver_client.gpio.children["led"]

        async def call_ms(fn: Callable[[], Any]) -> float:
            t0 = time.perf_counter()
            await asyncio.to_thread(fn)
            return (time.perf_counter() - t0) * 1000

        await asyncio.to_thread(button.off)
        report("jumpstarter: button.off() (gRPC + gpio.sock)", [await call_ms(button.off) for _ in range(runs * 3)])
        report("jumpstarter: led.read()", [await call_ms(led.read) for _ in range(runs * 3)])

        async def through_jumpstarter() -> float:
            return await call_ms(lambda: (button.on(), led.wait_for_active(10)))

        report("round trip, jumpstarter on()+wait_for_active(): sysfs builtin",
               await guest_round_trips(gpio, con, BUILTIN, runs, through_jumpstarter))
    finally:
        await asyncio.to_thread(serving.__exit__, None, None, None)
    await con.close()


async def bench(image: str, runs: int) -> None:
    """Boot, measure, print."""
    spec = {"image": image, "memory": "256M", "gpio": LINES}
    with tempfile.TemporaryDirectory(prefix="vmsidecar-bench-gpio-") as tmp:
        work = Path(tmp)
        with RuntimeProcess.start(work, spec=spec, cache=work / "cache") as rt:
            await measure(rt, spec, runs)


def main() -> None:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--image", help="default: the tiny guest built by vmsidecar-image")
    args = p.parse_args()
    image = args.image
    if image is None:
        from vmsidecar_images.build import build_image

        image = f"file:{build_image('tiny').disk}"
    asyncio.run(bench(image, args.runs))


if __name__ == "__main__":
    main()

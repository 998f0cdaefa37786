"""Boot benchmark: runtime start → Ready (image cached) and recycle → Ready, medians of N runs.

    uv run python bench/boot.py [--runs 5] [--image file:PATH] [--backend qemu|libvirt]

Prints one line per run and a summary with medians and the recycle/cold ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import time
from pathlib import Path

from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.process import RuntimeProcess


async def _serve_until_ready(work: Path, spec: dict, cache: Path) -> tuple[RuntimeProcess, float]:
    started = time.monotonic()
    rt = RuntimeProcess.start(work, spec=spec, cache=cache)
    try:
        await rt.wait_ready(300, poll=0.05)
    except BaseException:
        rt.stop()
        raise
    return rt, time.monotonic() - started


async def bench(image: str, runs: int, backend: str) -> dict[str, float]:
    """Measure and print; returns the medians."""
    spec = {"image": image, "memory": "256M", "backend": backend}
    cold: list[float] = []
    recycle: list[float] = []
    create: list[float] = []  # libvirt: createXML seconds, from the runtime log
    with tempfile.TemporaryDirectory(prefix="vmsidecar-bench-") as tmp:
        cache = Path(tmp) / "cache"
        # warm the cache once: the benchmark measures boots, not pulls
        rt, first = await _serve_until_ready(Path(tmp) / "warm", spec, cache)
        rt.stop()
        print(f"warm-up (pull + boot): {first:.2f} s")
        for i in range(runs):
            work = Path(tmp) / f"run{i}"

            rt, seconds = await _serve_until_ready(work, spec, cache)
            cold.append(seconds)
            with rt:
                async with RuntimeClient(rt.socket) as client:
                    t0 = time.monotonic()
                    await client.recycle()
                    await client.wait_ready(300, poll=0.05)
                    recycle.append(time.monotonic() - t0)
            create += [float(s) for s in re.findall(r"created paused in ([0-9.]+) s", rt.log_text())]
            print(f"run {i + 1}: start→Ready {cold[-1]:.2f} s, recycle→Ready {recycle[-1]:.2f} s")
    result = {"cold_median": statistics.median(cold), "recycle_median": statistics.median(recycle)}
    result["ratio"] = result["recycle_median"] / result["cold_median"]
    print(f"\n{backend}: runtime start→Ready median {result['cold_median']:.2f} s; "
          f"recycle→Ready median {result['recycle_median']:.2f} s; recycle/cold {result['ratio']:.2f} "
          f"({runs} runs, cached image)")
    if create:
        result["create_median"] = statistics.median(create)
        print(f"libvirt createXML median {result['create_median']:.2f} s (min {min(create):.2f}, max {max(create):.2f}, "
              f"{len(create)} domains)")
    return result


def main() -> None:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--image", help="default: the tiny guest built by vmsidecar-image")
    p.add_argument("--backend", default="qemu", choices=["qemu", "libvirt"])
    args = p.parse_args()
    image = args.image
    if image is None:
        from vmsidecar_images.build import build_image

        image = f"file:{build_image('tiny').disk}"
    asyncio.run(bench(image, args.runs, args.backend))


if __name__ == "__main__":
    main()

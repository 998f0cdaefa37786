"""Boot benchmark: runtime start → Ready (image cached) and recycle → Ready, medians of N runs.

    uv run python bench/boot.py [--runs 5] [--image file:PATH] [--backend qemu|libvirt]
    uv run python bench/boot.py --tree old=/tmp/old-checkout --tree new=/tmp/new-checkout   # side by side

Prints one line per run and a summary with medians and the recycle/cold ratio. ``--tree NAME=DIR``
(repeatable) runs the runtime of that checkout (its ``runtime/src`` and ``contract/src`` first on
the runtime's ``PYTHONPATH``, same venv), each with its own cache, the trees in alternation within
every run so that the machine's load falls on all alike; without it, this checkout's runtime.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import time
from pathlib import Path

from bytecode import compile_sources  # bench/ is no package
from trees import tree_pythonpath, with_pythonpath

from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.process import RuntimeProcess, clean_environ


def _tree_env(tree: Path | None) -> dict[str, str] | None:
    """The environment that makes the runtime that of ``tree`` (None: this checkout's)."""
    if tree is None:
        return None
    return with_pythonpath(clean_environ(), tree_pythonpath(tree))


async def _serve_until_ready(work: Path, spec: dict, cache: Path,
                             env: dict[str, str] | None = None) -> tuple[RuntimeProcess, float]:
    started = time.monotonic()
    rt = RuntimeProcess.start(work, spec=spec, cache=cache, env=env)
    try:
        await rt.wait_ready(300, poll=0.05)
    except BaseException:
        rt.stop()
        raise
    return rt, time.monotonic() - started


async def bench(image: str, runs: int, backend: str, trees: dict[str, Path | None]) -> dict[str, dict[str, float]]:
    """Measure and print; returns the medians per tree."""
    spec = {"image": image, "memory": "256M", "backend": backend}
    cold: dict[str, list[float]] = {name: [] for name in trees}
    recycle: dict[str, list[float]] = {name: [] for name in trees}
    create: list[float] = []  # libvirt: createXML seconds, from the runtime log
    with tempfile.TemporaryDirectory(prefix="vmsidecar-bench-") as tmp:
        for name, tree in trees.items():
            # warm each tree's cache once: the benchmark measures boots, not pulls
            rt, first = await _serve_until_ready(Path(tmp) / f"{name}-warm", spec, Path(tmp) / f"{name}-cache",
                                                 _tree_env(tree))
            rt.stop()
            print(f"{name}: warm-up (pull + boot): {first:.2f} s")
        for i in range(runs):
            for name, tree in trees.items():
                work = Path(tmp) / f"{name}-run{i}"
                rt, seconds = await _serve_until_ready(work, spec, Path(tmp) / f"{name}-cache", _tree_env(tree))
                cold[name].append(seconds)
                with rt:
                    async with RuntimeClient(rt.socket) as client:
                        t0 = time.monotonic()
                        await client.recycle()
                        await client.wait_ready(300, poll=0.05)
                        recycle[name].append(time.monotonic() - t0)
                create += [float(s) for s in re.findall(r"created paused in ([0-9.]+) s", rt.log_text())]
                print(f"run {i + 1} {name}: start→Ready {cold[name][-1]:.2f} s, recycle→Ready {recycle[name][-1]:.2f} s")
    results: dict[str, dict[str, float]] = {}
    for name in trees:
        result = {"cold_median": statistics.median(cold[name]), "recycle_median": statistics.median(recycle[name])}
        result["ratio"] = result["recycle_median"] / result["cold_median"]
        results[name] = result
        print(f"\n{name} ({backend}): runtime start→Ready median {result['cold_median']:.3f} s; "
              f"recycle→Ready median {result['recycle_median']:.3f} s; recycle/cold {result['ratio']:.2f} "
              f"({runs} runs, cached image)")
    if len(trees) > 1:
        base, *others = trees
        for name in others:
            print(f"{name} ÷ {base}: start→Ready {results[name]['cold_median'] / results[base]['cold_median']:.3f}, "
                  f"recycle→Ready {results[name]['recycle_median'] / results[base]['recycle_median']:.3f}")
    if create:
        print(f"libvirt createXML median {statistics.median(create):.2f} s (min {min(create):.2f}, "
              f"max {max(create):.2f}, {len(create)} domains)")
    return results


def _tree(arg: str) -> tuple[str, Path]:
    name, sep, path = arg.partition("=")
    if not sep or not name or not (Path(path) / "runtime" / "src").is_dir():
        raise argparse.ArgumentTypeError(f"{arg!r}: give NAME=DIR, DIR a checkout with runtime/src")
    return name, Path(path)


def main() -> None:
    """Entry point."""
    compile_sources()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--image", help="default: the tiny guest built by vmsidecar-image")
    p.add_argument("--backend", default="qemu", choices=["qemu", "libvirt"])
    p.add_argument("--tree", type=_tree, action="append", default=[], metavar="NAME=DIR",
                   help="a checkout whose runtime is measured (repeatable; default: this checkout's)")
    args = p.parse_args()
    image = args.image
    if image is None:
        from vmsidecar_images.build import build_image

        image = f"file:{build_image('tiny').disk}"
    trees: dict[str, Path | None] = dict(args.tree) or {"this": None}
    asyncio.run(bench(image, args.runs, args.backend, trees))


if __name__ == "__main__":
    main()

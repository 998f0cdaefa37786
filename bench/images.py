"""Image sizes against issue 14's goals, and what dominates each image.

    uv run python bench/images.py                 # localhost/vmsidecar-*:dev as they are
    uv run python bench/images.py --tag h5        # another tag
    uv run python bench/images.py --build         # scripts/build-images for every target first

Per image: its size, its layers (podman history), the biggest Debian packages (dpkg-query) and the
biggest Python distributions of /opt/vmsidecar (du). Builds nothing unless --build is given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "CONTAINERS_CONF": str(ROOT / "container" / "containers.conf")}
#: target -> goal in MB (issue 14); "vmsidecar" (all in one) has none: it is runtime + exporter
GOALS = {"runtime": 300, "runtime-libvirt": 450, "exporter": 350, "vmsidecar": None}
SITE = "/opt/vmsidecar/lib/python3.11/site-packages"


def image_name(target: str, tag: str) -> str:
    return f"localhost/vmsidecar:{tag}" if target == "vmsidecar" else f"localhost/vmsidecar-{target}:{tag}"


def podman(*args: str) -> str:
    result = subprocess.run(["podman", *args], env=ENV, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: {result.stderr.strip()[-500:]}")
    return result.stdout


def in_image(image: str, script: str) -> str:
    return podman("run", "--rm", "--network", "none", "--entrypoint", "/bin/sh", image, "-c", script)


def layers(image: str, top: int) -> list[tuple[float, str]]:
    rows = json.loads(podman("history", "--format", "json", image))
    out = [(r.get("size", 0) / 1e6, " ".join(r.get("CreatedBy", r.get("created_by", "")).split())[:90])
           for r in rows]
    return sorted(out, reverse=True)[:top]


def packages(image: str, top: int) -> list[tuple[float, str]]:
    text = in_image(image, "dpkg-query -W -f='${Installed-Size} ${Package}\\n'")
    rows = [(int(kb) / 1024, name) for kb, name in (line.split() for line in text.splitlines() if line.strip())]
    return sorted(rows, reverse=True)[:top]


def python_dists(image: str, top: int) -> tuple[float, list[tuple[float, str]]]:
    text = in_image(image, f"[ -d {SITE} ] && du -sk /opt/vmsidecar && du -sk {SITE}/* || true")
    rows = [(int(kb) / 1024, Path(p).name) for kb, p in (line.split("\t") for line in text.splitlines())]
    total, rows = (rows[0][0], rows[1:]) if rows else (0.0, [])
    return total, sorted(rows, reverse=True)[:top]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tag", default="dev")
    p.add_argument("--targets", nargs="+", default=list(GOALS))
    p.add_argument("--build", action="store_true", help="build the targets first (scripts/build-images)")
    p.add_argument("--top", type=int, default=8)
    args = p.parse_args(argv)
    if args.build:
        subprocess.run(["scripts/build-images"], cwd=ROOT, check=True,
                       env={**ENV, "TARGETS": " ".join(args.targets), "TAG": args.tag})
    summary = []
    for target in args.targets:
        image = image_name(target, args.tag)
        try:
            size = json.loads(podman("image", "inspect", image))[0]["Size"] / 1e6
        except RuntimeError:
            print(f"\n{image}: not built (scripts/build-images, or --build)")
            continue
        print(f"\n== {image}: {size:.0f} MB")
        print("  layers:")
        for mb, created in layers(image, args.top):
            print(f"    {mb:7.1f} MB  {created}")
        print("  Debian packages (installed size):")
        for mb, name in packages(image, args.top):
            print(f"    {mb:7.1f} MB  {name}")
        venv, dists = python_dists(image, args.top)
        print(f"  /opt/vmsidecar {venv:.0f} MB; biggest in site-packages:")
        for mb, name in dists:
            print(f"    {mb:7.1f} MB  {name}")
        summary.append((target, size, GOALS.get(target)))
    print(f"\n{'image':<18}{'size MB':>9}{'goal MB':>9}  verdict")
    for target, size, goal in summary:
        verdict = "-" if goal is None else ("meets" if size <= goal else f"{size - goal:.0f} MB over")
        print(f"{target:<18}{size:>9.0f}{goal or '-':>9}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``vmsidecar-image``: build guest recipes, list cached builds."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from vmsidecar_contract.arch import normalize_arch
from vmsidecar_contract.errors import VmsidecarError

from .build import build_image, cache_root, list_images, lock_recipe
from .recipe import available_recipes


def _arch(text: str) -> str:
    """``--arch``: an architecture this project builds for, or a usage error naming the ones it does."""
    try:
        return normalize_arch(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vmsidecar-image", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build a recipe (or reuse the cached build with the same inputs)")
    b.add_argument("name", help=f"recipe name ({', '.join(available_recipes())})")
    b.add_argument("--arch", type=_arch, default="x86_64", help="x86_64 (default) or aarch64")
    b.add_argument("--label", help="guest label (hostname, /etc/vmsidecar-image, readiness marker)")
    b.add_argument("--out", help="cache root for this build (default $VMSIDECAR_IMAGE_CACHE or ~/.cache)")
    b.add_argument("--force", action="store_true", help="rebuild even if a cached build exists")
    b.add_argument("--json", action="store_true", help="print the manifest instead of the directory")
    lk = sub.add_parser("lock", help="re-resolve a bootstrapped recipe's packages (debian) and rewrite the "
                        "snapshot in its versions.toml")
    lk.add_argument("name", help="recipe name (debian)")
    lk.add_argument("--arch", type=_arch, default="x86_64")
    lk.add_argument("--out", help="where the temporary bootstrap goes (default: the image cache root)")
    ls = sub.add_parser("list", help="list the cached builds")
    ls.add_argument("--out", help="cache root to list")
    ls.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(format="vmsidecar-image: %(levelname)s: %(message)s", level=logging.WARNING)
    if args.out:
        import os

        os.environ["VMSIDECAR_IMAGE_CACHE"] = args.out
    try:
        if args.command == "build":
            image = build_image(args.name, arch=args.arch, label=args.label, force=args.force)
            if args.json:
                print(json.dumps({**image.manifest, "dir": str(image.dir)}, indent=2, sort_keys=True))
            else:
                print(image.dir)
        elif args.command == "lock":
            changes = lock_recipe(args.name, arch=args.arch)
            for package, (old, new) in changes.items():
                print(f"{package}: {old or '-'} -> {new or '-'}")
            print(f"{len(changes)} package(s) changed", file=sys.stderr)
        elif args.command == "list":
            images = list_images()
            if args.json:
                print(json.dumps([{**i.manifest, "dir": str(i.dir)} for i in images], indent=2))
            elif not images:
                print(f"no builds in {cache_root()}", file=sys.stderr)
            else:
                for i in images:
                    m = i.manifest
                    size = m["files"]["disk.qcow2"]["size"] / (1 << 20)
                    print(f"{m['name']:8} {m['arch']:8} {m['label']:12} {m['input_hash'][:12]}  "
                          f"{size:5.1f} MiB  {i.dir}")  # fmt: skip
    except VmsidecarError as exc:
        print(f"vmsidecar-image: {exc.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

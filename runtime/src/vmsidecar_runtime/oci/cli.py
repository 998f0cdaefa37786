"""``vmsidecar-oci``: push, pull, inspect disk images and write OCI layouts.

Registry credentials and insecure registries are resolved as the runtime's (:mod:`.auth`):
``--registry-auth FILE``, ``VMSIDECAR_REGISTRY_AUTH_FILE``, ``REGISTRY_AUTH_FILE``, podman's and
Docker's files; ``--insecure-registry``/``--plain-http``. Errors print ``error: <message>`` and exit 2.
The pull/push/pack code loads in the command that uses it: ``--help`` and a mistyped command start
in ~0.05 s (tests/test_cli_imports.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from vmsidecar_contract.errors import VmsidecarError

from . import auth

if TYPE_CHECKING:
    from .pull import Progress

DEFAULT_CACHE = "/var/lib/vmsidecar/images"
ENV_CACHE = "VMSIDECAR_CACHE_DIR"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (one sub-command per operation)."""
    parser = argparse.ArgumentParser(prog="vmsidecar-oci", description="OCI disk images for vmsidecar")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_http(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--plain-http",
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"talk HTTP instead of HTTPS to this registry (default: HTTP only for registries listed by "
            f"{auth.INSECURE_FLAG} or {auth.ENV_INSECURE})",
        )
        p.add_argument(
            auth.INSECURE_FLAG,
            action="append",
            default=[],
            metavar="HOST[:PORT]",
            help=f"a registry spoken to in plain HTTP (repeatable; also {auth.ENV_INSECURE}, comma-separated)",
        )
        p.add_argument(
            auth.AUTH_FLAG,
            type=Path,
            metavar="FILE",
            help=f"containers-auth.json / Docker config.json with the registry credentials (default "
            f"{auth.ENV_AUTH_FILE}, {auth.ENV_CONTAINERS_AUTH_FILE}, then podman's and Docker's files)",
        )

    def add_readiness(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("readiness the image carries (annotations io.vmsidecar.readiness.*; used "
                                 "where the VM spec sets none)")
        g.add_argument("--readiness-pattern", metavar="REGEX",
                       help="regex the guest prints once it is up ('' = Ready as soon as it runs)")
        g.add_argument("--readiness-console", choices=["ttyS0", "hvc0"], help="console the pattern appears on")
        g.add_argument("--readiness-timeout", type=float, metavar="SECONDS", help="seconds from power-on")

    p = sub.add_parser("push", help="push a disk to a registry")
    p.add_argument("disk", type=Path)
    p.add_argument("ref", help="REGISTRY/REPO:TAG")
    p.add_argument("--form", choices=["artifact", "containerdisk"], default="artifact")
    p.add_argument("--arch", default="x86_64", help="x86_64|aarch64 (or amd64|arm64); default x86_64")
    p.add_argument(
        "--compression", choices=["zstd", "gzip", "none"], default="zstd", help="artifact form only"
    )
    add_http(p)
    add_readiness(p)

    p = sub.add_parser("layout", help="write a disk into an OCI image layout directory")
    p.add_argument("disk", type=Path)
    p.add_argument("dir", type=Path)
    p.add_argument("--tag", default="latest")
    p.add_argument("--form", choices=["artifact", "containerdisk"], default="artifact")
    p.add_argument("--arch", default="x86_64")
    p.add_argument("--compression", choices=["zstd", "gzip", "none"], default="zstd")
    add_readiness(p)

    p = sub.add_parser("pull", help="pull a disk into the cache and print where it is")
    p.add_argument("ref", help="REGISTRY/REPO:TAG[@DIGEST], oci-layout:DIR[:TAG] or file:PATH")
    p.add_argument(
        "--cache", type=Path, default=None, help=f"cache root (default ${ENV_CACHE} or {DEFAULT_CACHE})"
    )
    p.add_argument("--arch", default=None, help="default: the host's")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_http(p)

    p = sub.add_parser("snapshot", help="memory snapshots as registry artifacts")
    snap_sub = p.add_subparsers(dest="snapshot_command", required=True)
    p = snap_sub.add_parser(
        "push", help="publish the snapshot a runtime captured for a spec, as an OCI artifact referring to its image",
        description="Publish the memory snapshot of SPEC's guest from the cache (a runtime with that spec must "
        "have reached Ready on it) as an OCI 1.1 artifact whose subject is the image's manifest; a runtime "
        "whose spec sets snapshot_source to REGISTRY/REPO then starts from it on an empty cache.")
    p.add_argument("ref", help="REGISTRY/REPO[:TAG] (runtimes name REGISTRY/REPO as their snapshot_source)")
    p.add_argument(
        "--cache", type=Path, default=None, help=f"cache root (default ${ENV_CACHE} or {DEFAULT_CACHE})"
    )
    p.add_argument("--spec", type=Path, default=None,
                   help="the VM spec the runtime ran (YAML/JSON; also VMSIDECAR_SPEC and VMSIDECAR_* as for the runtime)")
    add_http(p)

    p = sub.add_parser("inspect", help="print what a reference resolves to (no disk download)")
    p.add_argument("ref")
    p.add_argument("--arch", default=None)
    add_http(p)
    return parser


@contextlib.contextmanager
def _progress_bar(enabled: bool) -> Iterator[Progress | None]:
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task("pulling", total=None)

        def update(done: int, total: int | None) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _compression(name: str) -> str | None:
    return None if name == "none" else name


def _annotations(args: argparse.Namespace) -> dict[str, str]:
    from .pack import readiness_annotations  # here: pack imports the image checks, zstandard, pydantic

    return readiness_annotations(args.readiness_pattern, args.readiness_console, args.readiness_timeout)


def run(args: argparse.Namespace) -> int:
    """Execute a parsed command; returns the exit code.

    :raise VmsidecarError: whatever the operation raises.
    """
    if args.command == "push":
        from .push import push  # each command imports its part of the OCI stack, not --help

        start = time.monotonic()
        digest = push(
            args.disk,
            args.ref,
            form=args.form,
            arch=args.arch,
            plain_http=args.plain_http,
            compression=_compression(args.compression),  # type: ignore[arg-type]
            annotations=_annotations(args),
        )
        print(f"{args.ref}@{digest}" if "@" not in args.ref else digest)
        print(f"pushed in {time.monotonic() - start:.2f} s", file=sys.stderr)
        return 0
    if args.command == "layout":
        from .layout import write_layout

        digest = write_layout(
            args.disk,
            args.dir,
            tag=args.tag,
            form=args.form,
            arch=args.arch,
            compression=_compression(args.compression),  # type: ignore[arg-type]
            annotations=_annotations(args),
        )
        print(f"oci-layout:{args.dir}:{args.tag} {digest}")
        return 0
    if args.command == "pull":
        from .pull import pull

        cache = args.cache or Path(os.environ.get(ENV_CACHE) or DEFAULT_CACHE)
        start = time.monotonic()
        with _progress_bar(sys.stderr.isatty()) as progress:
            disk = pull(args.ref, cache, arch=args.arch, plain_http=args.plain_http, progress=progress)
        elapsed = time.monotonic() - start
        if args.json:
            print(json.dumps({**disk.to_dict(), "seconds": round(elapsed, 3)}, indent=2))
        else:
            print(disk.path)
            state = "cached" if disk.cached else f"{disk.bytes_downloaded} bytes downloaded"
            print(
                f"{disk.format} {disk.digest} ({disk.size} bytes, {state}, {elapsed:.2f} s)", file=sys.stderr
            )
        return 0
    if args.command == "snapshot":
        from vmsidecar_contract.spec import spec_from_sources

        from .snapshot_push import push_snapshot

        cache = args.cache or Path(os.environ.get(ENV_CACHE) or DEFAULT_CACHE)
        start = time.monotonic()
        pushed = push_snapshot(args.ref, cache, spec_from_sources(args.spec), plain_http=args.plain_http,
                               waiting=lambda: print("waiting for the capture under way in a runtime on this cache",
                                                     file=sys.stderr, flush=True))
        print(pushed.reference)
        print(f"snapshot {pushed.key} of {pushed.subject}: {pushed.entry_bytes >> 20} MB in the cache, "
              f"{pushed.pushed_bytes >> 20} MB pushed in {time.monotonic() - start:.2f} s"
              + (" (referrers tag schema updated)" if pushed.tag_schema else ""), file=sys.stderr)
        return 0
    if args.command == "inspect":
        from .pull import inspect

        result = inspect(args.ref, arch=args.arch, plain_http=args.plain_http)
        print(json.dumps(result, indent=2))
        if "error" in result:
            print(f"error: {result['error']['message']}", file=sys.stderr)
            return 2
        return 0
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vmsidecar-oci``."""
    args = build_parser().parse_args(argv)
    try:
        with auth.settings(auth_file=getattr(args, "registry_auth", None),
                           insecure=getattr(args, "insecure_registry", ())):
            return run(args)
    except VmsidecarError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("VMSIDECAR_DEBUG"):
            raise
        print(
            f"error: unexpected {type(exc).__name__}: {exc}; rerun with VMSIDECAR_DEBUG=1 for the traceback "
            "and report it",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""``jumpstarter-exec`` as vmsidecar's exporter image provides it (``/jumpstarter/bin/jumpstarter-exec``).

Upstream's pool pods copy that file out of the exporter image into ``/shared`` (init container
``copy-jumpstarter-exec``), and a jumpstarter with ``exitOnLeaseEnd`` runs
``/shared/jumpstarter-exec shutdown --socket $JUMPSTARTER_LAUNCHER_SOCKET`` when a lease ends.
Here ``shutdown`` stops the vmsidecar runtime through its API (``POST /v1/shutdown``) and
``version`` answers; ``exec`` and ``serve`` are refused on purpose: vmsidecar has no endpoint that
runs arbitrary commands.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.errors import VmsidecarError

VERSION = "vmsidecar-compat 1"


def api_socket(launcher_socket: str | None) -> Path:
    """The runtime's api.sock: ``VMSIDECAR_API_SOCKET``, else ``<dir of the launcher socket>/vmsidecar/api.sock``."""
    if os.environ.get("VMSIDECAR_API_SOCKET"):
        return Path(os.environ["VMSIDECAR_API_SOCKET"])
    base = Path(launcher_socket).parent if launcher_socket else Path("/shared")
    return base / "vmsidecar" / "api.sock"


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(prog="jumpstarter-exec", description=__doc__)
    p.add_argument("command", choices=["serve", "exec", "shutdown", "version"])
    p.add_argument("--socket", default=os.environ.get("JUMPSTARTER_LAUNCHER_SOCKET"))
    p.add_argument("rest", nargs=argparse.REMAINDER)
    args, _ = p.parse_known_args(argv)
    if args.command == "version":
        print(VERSION)
        return 0
    if args.command in ("exec", "serve"):
        print(f"jumpstarter-exec: '{args.command}' is not available with vmsidecar, which runs no commands on "
              "request; use the driver jumpstarter_driver_vmsidecar.driver.VirtualMachine", file=sys.stderr)
        return 1
    socket = api_socket(args.socket)

    async def shutdown() -> None:
        async with RuntimeClient(socket, timeout=60) as client:
            await client.shutdown()

    try:
        asyncio.run(shutdown())
    except VmsidecarError as e:
        print(f"jumpstarter-exec: {e.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

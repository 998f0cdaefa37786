"""Host ports for port forwards: chosen free at boot, so instances on one host never collide."""

from __future__ import annotations

import socket

from vmsidecar_contract.errors import HostError
from vmsidecar_contract.spec import PortForward


class PortTaken(HostError):
    """A fixed forward's host port is another process's: the host's problem, not the guest's or a
    snapshot's (a restore that meets it fails the boot and keeps the snapshot)."""


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def allocate(forwards: list[PortForward]) -> dict[str, int]:
    """Resolve each forward's host port: the fixed one if set and free, else a free one.

    :raise PortTaken: when a fixed port is taken.
    """
    result: dict[str, int] = {}
    for fwd in forwards:
        if fwd.host_port:
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    # as QEMU's slirp binds it: a connection of the last lease in TIME_WAIT on the
                    # port does not keep it (without, the recycle after a lease that used a fixed
                    # forward failed, "in use"); a socket listening on it still does
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind((fwd.host_address, fwd.host_port))
            except OSError as e:
                raise PortTaken(
                    f"host port {fwd.host_port} for forward {fwd.name!r} is in use ({e.strerror}); "
                    "set host_port: 0 to let the runtime pick a free one"
                ) from e
            result[fwd.name] = fwd.host_port
        else:
            result[fwd.name] = _free_port(fwd.host_address)
    return result

"""Host checks for the opt-in native CAN path (``mode: native``: kvaser_pci bridged to host SocketCAN)."""

from __future__ import annotations

from pathlib import Path

from .errors import SpecError
from .spec import VmSpec

#: ARPHRD_CAN in /sys/class/net/<if>/type
ARPHRD_CAN = 280


def check_native_can(spec: VmSpec, sys_net: Path = Path("/sys/class/net")) -> None:
    """Refuse native CAN buses whose host interface is not a SocketCAN interface here.

    :raise SpecError: naming the bus, what is missing on this host and the portable path.
    """
    for i, bus in enumerate(spec.can):
        if bus.mode != "native":
            continue
        where = f"can.{i}.host_interface"
        dev = sys_net / str(bus.host_interface)
        try:
            kind = int((dev / "type").read_text().strip())
        except (OSError, ValueError):
            kind = None
        if kind == ARPHRD_CAN:
            continue
        has_can = Path("/proc/net/can").exists()
        missing = (
            f"host interface {bus.host_interface!r} does not exist" if kind is None
            else f"host interface {bus.host_interface!r} is not a CAN interface"
        )
        kernel = "" if has_can else " and this host's kernel has no SocketCAN support (no /proc/net/can; modprobe can vcan fails)"
        raise SpecError(
            f"invalid VM spec: {where}: CAN bus {bus.name!r} uses mode native, but {missing}{kernel}; "
            "create the SocketCAN interface on the host (e.g. `ip link add dev vcan0 type vcan`), or use "
            "mode: slcan (the default, portable path: no host kernel support or privilege needed)"
        )

"""The runtime's one VM: the controller (``vm``) with its state machine (``phase``), and its
collaborators, each in its own module: power, boot, machine, snapshot_ops, lease, disk_ops,
transfers, disks, streams, readiness."""

from .paths import RuntimePaths
from .vm import VmController

__all__ = ["RuntimePaths", "VmController"]

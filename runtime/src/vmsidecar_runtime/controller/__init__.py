"""The runtime's one VM: the state machine (``vm``) and what it delegates to — disks, guest
streams and devices, readiness — each in its own module."""

from .paths import RuntimePaths
from .vm import VmController

__all__ = ["RuntimePaths", "VmController"]

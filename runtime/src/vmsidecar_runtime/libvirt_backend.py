"""``backend: libvirt`` entry point (the controller imports ``LibvirtBackend`` from here).

The implementation lives in the ``libvirt`` subpackage; libvirt-python is an optional extra and
only needed once a libvirt boot starts (``LibvirtBackend`` raises ``HostError`` with the fix).
"""

from __future__ import annotations

from .libvirt.backend import LibvirtBackend
from .libvirt.daemon import close_all

__all__ = ["LibvirtBackend", "close_all"]

"""Picks the backend for one boot. Separate from ``base`` because it imports the
implementations, which import ``base``: the protocol stays free of them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..plan import BootPlan
from .base import Backend, EventSink

if TYPE_CHECKING:
    from .libvirt.backend import LibvirtBackend
    from .qemu import QemuBackend


def _backend_class(name: str) -> type[QemuBackend] | type[LibvirtBackend]:
    if name == "libvirt":
        # optional extra: imported (and libvirt-python with it) only when a spec asks for it
        from .libvirt.backend import LibvirtBackend

        return LibvirtBackend
    from .qemu import QemuBackend

    return QemuBackend


def create_backend(plan: BootPlan, on_event: EventSink) -> Backend:
    """The backend ``plan.spec.backend`` names, for one boot of ``plan``.

    :raise HostError: for ``libvirt`` when libvirt-python (the ``libvirt`` extra) is missing.
    """
    return _backend_class(plan.spec.backend)(plan, on_event)


def supports_snapshots(backend: str) -> bool:
    """Whether the backend named ``backend`` (``spec.backend``) saves and restores memory snapshots:
    its ``supports_snapshots``, asked before a boot builds one (the snapshot decision comes first)."""
    return _backend_class(backend).supports_snapshots

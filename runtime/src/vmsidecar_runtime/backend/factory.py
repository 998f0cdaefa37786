"""Picks the backend for one boot. Separate from ``base`` because it imports the
implementations, which import ``base``: the protocol stays free of them."""

from __future__ import annotations

from ..plan import BootPlan
from .base import Backend, EventSink


def create_backend(plan: BootPlan, on_event: EventSink) -> Backend:
    """The backend ``plan.spec.backend`` names, for one boot of ``plan``.

    :raise HostError: for ``libvirt`` when libvirt-python (the ``libvirt`` extra) is missing.
    """
    if plan.spec.backend == "libvirt":
        # optional extra: imported (and libvirt-python with it) only when a spec asks for it
        from .libvirt.backend import LibvirtBackend

        return LibvirtBackend(plan, on_event)
    from .qemu import QemuBackend

    return QemuBackend(plan, on_event)

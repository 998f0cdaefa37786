"""The hypervisor backends behind the controller: direct QEMU (``qemu``, QMP) and libvirt
(``libvirt``, the optional extra), behind one protocol with backend-neutral events (``base``).

``create_backend`` picks one per boot from the spec; ``close_backends`` stops what backends share
across boots (the private libvirtd) at runtime exit. Importing this package loads no backend.
"""

from __future__ import annotations

from .base import Backend, BackendEvent, BackendFactory, EventSink, close_backends
from .factory import create_backend

__all__ = ["Backend", "BackendEvent", "BackendFactory", "EventSink", "close_backends", "create_backend"]

"""A minimal in-test Jumpstarter controller + router speaking the real 0.9.0 gRPC services.

See docs/testing-controller.md. Entry point for tests: :class:`JmpController`.
"""

from .harness import JmpController, LeaseHandle, stop_process

__all__ = ["JmpController", "LeaseHandle", "stop_process"]

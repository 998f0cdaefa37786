"""Test-only drivers for exporter lifecycle experiments (importable by ``jmp run`` because
``JmpController.env()`` puts ``tests/`` on PYTHONPATH)."""

from __future__ import annotations

import itertools
import os

from jumpstarter_driver_power.driver import MockPower
from pydantic.dataclasses import dataclass

# Every exporter child builds one driver tree to register, then one per lease.
_trees = itertools.count(1)


@dataclass(kw_only=True)
class ExitOnLeaseClose(MockPower):
    """MockPower whose ``close()`` at the end of the first lease ends the exporter child
    with ``os._exit(exit_code)`` (the first tree, used only for registration, closes normally)."""

    exit_code: int = 0

    def __post_init__(self):
        super().__post_init__()
        self._tree = next(_trees)

    def close(self):
        super().close()
        if self._tree >= 2:
            self.logger.info("closing lease tree %d: os._exit(%d)", self._tree, self.exit_code)
            os._exit(self.exit_code)

"""Fixtures shared by tests/ and e2e/: a real registry, the tiny guest images, runtime processes,
real `jmp` processes and the in-test Jumpstarter controller (tests/fixtures/)."""

from __future__ import annotations

import pytest

pytest_plugins = ["fixtures.registry", "fixtures.images", "fixtures.runtime", "fixtures.jmp", "fixtures.controller"]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under ``pytest -n 2 --dist loadgroup`` (scripts/test), the e2e tests run on one worker, in order:
    they share the podman images, the pods' names and the module-scoped registry pushes."""
    for item in items:
        if item.nodeid.startswith("e2e/"):
            item.add_marker(pytest.mark.xdist_group("e2e"))

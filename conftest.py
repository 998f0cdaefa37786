"""Fixtures shared by tests/ and e2e/: a real registry, the tiny guest images, runtime processes,
real `jmp` processes and the in-test Jumpstarter controller (tests/fixtures/)."""

from __future__ import annotations

import pytest

pytest_plugins = ["fixtures.registry", "fixtures.images", "fixtures.runtime", "fixtures.jmp", "fixtures.controller",
                  "fixtures.fake_backend"]


#: the tests that run podman (pods, builds, pushes)
PODMAN_TESTS = ("e2e/", "tests/test_byo_guest.py")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under ``pytest -n 4 --dist loadgroup`` (scripts/test), every test that drives podman runs on one
    worker, in order: the e2e tests share the podman images, the pods' names and the module-scoped
    registry pushes, and a ``podman build``/``push`` of another worker running beside ``podman kube
    play`` left pods whose runtime found its shared dir taken (in 2 of 2 parallel runs; the same e2e
    tests pass alone, also with 4 CPU hogs beside them)."""
    for item in items:
        if item.nodeid.startswith(PODMAN_TESTS):
            item.add_marker(pytest.mark.xdist_group("podman"))
            item.add_marker(pytest.mark.podman)

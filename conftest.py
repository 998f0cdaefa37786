"""Fixtures shared by tests/ and e2e/: a real registry, the tiny guest images, runtime processes,
real `jmp` processes and the in-test Jumpstarter controller (tests/fixtures/)."""

from __future__ import annotations

import importlib
import os
import pkgutil
from asyncio.base_subprocess import BaseSubprocessTransport
from typing import Any

import anyio
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
    tests pass alone, also with 4 CPU hogs beside them): with the grouping broken (see below), two pods
    at once share one shared directory."""
    for item in items:
        if item.nodeid.startswith(PODMAN_TESTS):
            item.add_marker(pytest.mark.xdist_group("podman"))
            item.add_marker(pytest.mark.podman)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """Under ``--dist loadgroup``, refuse to run the podman tests ungrouped: pytest-xdist marks a
    group by a suffix on the node id, which pytest 9.2 no longer lets it write
    (pytest-dev/pytest-xdist#1386), and nothing else would say that the grouping is gone."""
    ungrouped = [i for i in ids if i.startswith(PODMAN_TESTS) and not i.endswith("@podman")]
    if ungrouped and node.config.getvalue("dist") == "loadgroup":
        pytest.exit(f"pytest-xdist's --dist loadgroup did not group {ungrouped[0]} (and {len(ungrouped) - 1} "
                    "more): this pytest and pytest-xdist do not work together (pytest-dev/pytest-xdist#1386); "
                    "use the pytest that pyproject.toml pins (uv sync --frozen)", returncode=4)


def _import_anyio_now() -> None:
    """Import all of anyio now, before any test. anyio is a pytest plugin, so pytest rewrites its
    modules as they are imported (it parses them with ``ast``), and anyio imports its submodules
    lazily: mid-test, in Jumpstarter's portal thread, with asyncio garbage of earlier tests waiting.
    CPython 3.11.7 does not survive a collection (or a thread switch) inside a parse whose finalizers
    parse too ("SystemError: AST constructor recursion depth mismatch", python/cpython#106905; it failed
    test_can.py's fixture in a CI run): see fixtures/source.py, which the source-reading tests use."""
    for module in pkgutil.walk_packages(anyio.__path__, "anyio."):
        if not module.name.startswith("anyio._backends._trio"):  # needs trio, which we do not install
            importlib.import_module(module.name)


_import_anyio_now()


def _name_the_owner_of_a_transport_collected_too_late() -> None:
    """Make the intermittent ``Exception ignored in BaseSubprocessTransport.__del__ … Event loop is
    closed`` warning say whose it is. An asyncio subprocess whose pipe was still open when its test's
    event loop closed is collected by a later test, which pytest then names; seen in 2 of ~20 CI runs,
    never reproduced. Each transport now records the test that made it, and the error names that test
    and the program."""
    init, delete = BaseSubprocessTransport.__init__, BaseSubprocessTransport.__del__

    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        self._made_by_test = os.environ.get("PYTEST_CURRENT_TEST", "no test")
        init(self, *args, **kwargs)

    def naming_del(self: Any, *args: Any) -> None:
        try:
            delete(self, *args)
        except RuntimeError as exc:
            program = getattr(getattr(self, "_proc", None), "args", "?")
            raise RuntimeError(f"{exc}: the asyncio subprocess {program!r} made by "
                               f"{getattr(self, '_made_by_test', '?')} had a pipe open when that test's "
                               "event loop closed") from exc

    BaseSubprocessTransport.__init__ = recording_init  # type: ignore[method-assign]
    BaseSubprocessTransport.__del__ = naming_del  # type: ignore[method-assign]


_name_the_owner_of_a_transport_collected_too_late()

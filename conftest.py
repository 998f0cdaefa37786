"""Fixtures shared by tests/ and e2e/: a real registry, the tiny guest images, runtime processes,
real `jmp` processes and the in-test Jumpstarter controller (tests/fixtures/)."""

from __future__ import annotations

import importlib
import os
import pkgutil
import weakref
from asyncio.base_subprocess import BaseSubprocessTransport
from asyncio.unix_events import _UnixSelectorEventLoop
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


def _fail_the_test_whose_loop_closes_on_an_open_subprocess_pipe() -> None:
    """An asyncio subprocess whose pipe is still open when its event loop closes is collected later,
    on the closed loop: an "Exception ignored in BaseSubprocessTransport.__del__ … Event loop is
    closed" warning, pinned on whichever test the collector happens to run in (2 of ~20 CI runs). It
    was tests/test_races.py, whose controller was closed without ``close_backends``, serve's last
    step, so QEMU's reap was left behind. Now each transport records the test that made it, and an
    event loop that closes with one of its subprocesses' pipes open fails the test closing it."""
    transports: weakref.WeakSet[BaseSubprocessTransport] = weakref.WeakSet()
    init, close = BaseSubprocessTransport.__init__, _UnixSelectorEventLoop.close

    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        self._made_by_test = os.environ.get("PYTEST_CURRENT_TEST", "no test")
        init(self, *args, **kwargs)
        transports.add(self)

    def checking_close(self: Any) -> None:
        left = [t for t in transports if t._loop is self and any(
            p is not None and p.pipe is not None and not p.pipe.is_closing() for p in t._pipes.values())]
        for transport in left:  # closed while the loop is open: not reported again when collected
            transport.close()
        close(self)
        if left:
            made = "; ".join(f"{t._proc.args if t._proc else '?'!r} made by {t._made_by_test}" for t in left)
            raise RuntimeError(f"an event loop closed with asyncio subprocesses whose pipes were open: "
                               f"{made}; read them to their end (or close them) before the loop closes")

    BaseSubprocessTransport.__init__ = recording_init  # type: ignore[method-assign]
    _UnixSelectorEventLoop.close = checking_close  # type: ignore[method-assign]


_fail_the_test_whose_loop_closes_on_an_open_subprocess_pipe()

"""Fixtures shared by tests/ and e2e/: a real registry, the tiny guest images, runtime processes,
real `jmp` processes and the in-test Jumpstarter controller (tests/fixtures/)."""

pytest_plugins = ["fixtures.registry", "fixtures.images", "fixtures.runtime", "fixtures.jmp", "fixtures.controller"]

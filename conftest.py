"""Shared fixtures: real registry, the tiny guest image, runtime processes."""

pytest_plugins = ["fixtures.registry", "fixtures.images", "fixtures.runtime", "fixtures.jmp", "fixtures.controller"]

"""Shared fixtures: real registry, the tiny guest image, runtime instances."""

pytest_plugins = ["fixtures.registry", "fixtures.images"]

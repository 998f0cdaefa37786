"""Jumpstarter drivers for a VM served by the vmsidecar runtime."""

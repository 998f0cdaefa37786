"""vmsidecar runtime: boots a guest disk from OCI under QEMU and serves a Unix-socket API."""

"""The wire contract between the vmsidecar runtime and its clients (the exporter's drivers, the
CLI, tests): the VM spec, the state model, the error registry, the API's request models and the
API clients (``client.RuntimeClient``, async; ``blocking.BlockingRuntimeClient`` for the CLI,
which must start in well under 0.25 s). It has no hypervisor dependency, so the exporter image carries none."""

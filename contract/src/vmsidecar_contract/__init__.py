"""The wire contract between the vmsidecar runtime and its clients (the exporter's drivers, the
CLI, tests): the VM spec, the state model, the error registry, the API's request models and the
API client. It has no hypervisor dependency, so the exporter image carries none."""

"""Guest image recipes for vmsidecar."""

"""Direct QEMU backend: argv from the spec, QMP through qemu.qmp."""

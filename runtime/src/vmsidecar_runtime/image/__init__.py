"""Guest disks on the host: the one place that sniffs, decompresses, sizes and checks them.

Pull (:mod:`vmsidecar_runtime.oci.unpack`), flash (:mod:`vmsidecar_runtime.disk`) and push
(:mod:`vmsidecar_runtime.oci.pack`) all go through this package, so a rule added here holds for
all of them. The checks used to exist twice and only the pull copy refused backing files: a
flashed qcow2 naming ``/etc/hostname`` as its backing file made QEMU open that host file.

The pipeline, one module a step (import from the module that holds a name; nothing is
re-exported here):

1. :mod:`.sniff`: compression and disk format from the first bytes, and the format to boot.
2. :mod:`.decompress`: :func:`~.decompress.open_decompressed`, a bounded streaming reader that
   refuses a truncated stream and one past ``max_disk_bytes``.
3. :mod:`.write`: :func:`~.write.write_disk` refuses an unsafe qcow2 header before writing, then
   writes and hashes the disk.
4. :mod:`.checks`: :func:`~.checks.check_image` on the written file (header, ``qemu-img info``
   and ``check``, virtual size).

:mod:`.limits` holds the size limits and :class:`~.limits.Origin` (how messages name an image),
:mod:`.digest` the ``sha256:<hex>`` spelling shared with the OCI code.
"""

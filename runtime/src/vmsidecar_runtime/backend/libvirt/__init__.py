"""The libvirt backend: the same boot plan and API, driven through libvirt-python (optional extra).

``xml`` renders a boot plan as domain XML (pure), ``daemon`` starts the runtime's private libvirtd
(in its own mount+PID namespace, PID 1 ``nsinit``) when the spec names no ``libvirt_uri``,
``connection`` owns the connections and libvirt's event thread, ``backend`` is the ``Backend``.
``libvirt-python`` is imported lazily, so the runtime works without the extra as long as nobody
asks for ``backend: libvirt``.
"""

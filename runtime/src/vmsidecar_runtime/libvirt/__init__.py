"""The libvirt backend: the same VM spec and API, driven through libvirt-python (optional extra).

``xml`` renders a boot plan as domain XML (pure), ``daemon`` owns the connection (and, with no
``libvirt_uri``, a private libvirtd in its own mount+PID namespace), ``backend`` is the
``Backend`` the controller drives. ``libvirt-python`` is imported lazily, so the runtime works
without the extra as long as nobody asks for ``backend: libvirt``.
"""

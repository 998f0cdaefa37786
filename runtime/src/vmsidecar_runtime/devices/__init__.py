"""Devices the runtime emulates itself, next to QEMU.

- :mod:`.virtqueue`: guest memory and split virtqueues as a vhost-user backend sees them;
- :mod:`.vhost_user`: a generic vhost-user slave (the socket protocol), no device knowledge;
- :mod:`.virtio_gpio`: the virtio-gpio device model on top of it;
- :mod:`.gpio_control`: the host's JSON-lines control socket for the GPIO lines;
- :mod:`.gpio`: :class:`~.gpio.GpioDevice`, the three together, as the controller uses them.
"""

# Loaded by /etc/rcS at boot (busybox `modprobe -a`), in this order.
virtio_pci
virtio_console
virtio_blk
virtio_net
virtio_rng
button
evdev
ext4
vfat

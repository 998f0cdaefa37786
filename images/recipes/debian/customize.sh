#!/bin/sh
# mmdebstrap --customize-hook of the debian guest: runs on the build host after every package is
# installed and the guest files are in; the root file system is "$1".
set -eu
root="$1"

# DHCP on the virtio NIC (etc/systemd/network/20-vmsidecar.network); the readiness marker.
chroot "$root" systemctl enable systemd-networkd.service vmsidecar-ready.service

# Build-time only: the snapshot pins, the bootstrap's apt options, resolved's backup of the host's
# resolv.conf.
rm -f "$root/etc/apt/preferences.d/vmsidecar-snapshot" "$root/etc/apt/apt.conf.d/99mmdebstrap" \
    "$root/etc/.resolv.conf.systemd-resolved.bak"

#!/usr/bin/env bash
# Podman and a local Debian base image, for building and running inferd's container image
# on a machine that has no Docker engine and can pull no image (this project's machines).
#
#   bash scripts/container-base.sh        # idempotent; prints the base image's name
#   podman build --build-arg BASE_IMAGE=localhost/debian-py:bookworm -t inferd .
#
# Everything specific to this machine lives here, never in the Dockerfile: podman with
# runc (crun fails on this host's hybrid cgroups), ulimits root may set, and the host's
# extra CA certificates (HTTPS egress is TLS-intercepted) trusted inside the base image.
# See shared/containers.md for why each step is needed.
set -euo pipefail

IMAGE=${INFERD_BASE_IMAGE_NAME:-localhost/debian-py:bookworm}
SUITE=bookworm
WORK=${TMPDIR:-/tmp}/inferd-container-base

need=()
for tool in podman runc debootstrap newuidmap slirp4netns fuse-overlayfs; do
    command -v "$tool" >/dev/null || need+=("$tool")
done
if ((${#need[@]})); then
    echo "installing podman, runc, debootstrap (missing: ${need[*]})" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        podman runc uidmap slirp4netns fuse-overlayfs debootstrap >/dev/null
fi

conf=/etc/containers/containers.conf
if ! grep -qs 'inferd: container-base.sh' "$conf"; then
    mkdir -p /etc/containers
    hard=$(ulimit -Hn)
    cat >"$conf" <<EOF
# inferd: container-base.sh -- runc (crun fails on hybrid cgroups here); rlimits root may set
[containers]
default_ulimits = ["nofile=$hard:$hard", "nproc=32768:32768"]
[engine]
runtime = "runc"
EOF
fi

if podman image exists "$IMAGE"; then
    echo "$IMAGE"
    exit 0
fi

# The host's own Debian mirror (deb822 sources first, then the one-line format).
mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
if [[ -z "$mirror" ]]; then
    mirror=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
fi
mirror=${mirror:-http://deb.debian.org/debian}

rm -rf "$WORK"
mkdir -p "$WORK"
trap 'rm -rf "$WORK"' EXIT
rootfs=$WORK/rootfs
echo "debootstrap $SUITE from $mirror (about a minute)" >&2
debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates \
    "$SUITE" "$rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 || {
    tail -20 "$WORK/debootstrap.log" >&2
    exit 1
}
# bookworm-updates too, as the host's sources and the usual slim image have it
echo "deb $mirror $SUITE-updates main" >>"$rootfs/etc/apt/sources.list"
shopt -s nullglob
extra=(/usr/local/share/ca-certificates/*.crt)
if ((${#extra[@]})); then
    cp "${extra[@]}" "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates >/dev/null
fi
chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c --numeric-owner -f "$WORK/base.tar" .
podman import --change 'CMD ["/bin/bash"]' "$WORK/base.tar" "$IMAGE" >/dev/null
echo "$IMAGE"

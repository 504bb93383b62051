#!/usr/bin/env bash
# Build the Kalos image where no container registry is reachable: the base image comes from a
# Debian mirror (debootstrap minbase bookworm with python3 and python3-venv, then podman import),
# the image from deploy/container/Containerfile with `podman build --isolation chroot` (no OCI
# runtime needed, so no cgroup or rlimit set-up). Root only (debootstrap, podman's storage).
#
#   deploy/container/build-local.sh [TAG]          default TAG: localhost/kalos:$VARIANT
#
# Environment:
#   VARIANT            cpu (default) or cuda12, as in the Containerfile
#   KALOS_IMAGE_CACHE  where the debootstrapped base is kept as a tarball, so that a machine whose
#                      podman storage was wiped (or a CI cache) skips debootstrap
#                      (default /var/tmp/kalos-image-cache)
#   DEBIAN_MIRROR      default http://deb.debian.org/debian
#   KALOS_BUILD_CA_BUNDLE  CA certificates pip trusts during the build (default: this host's
#                      /etc/ssl/certs/ca-certificates.crt; empty: the image's own)
#
# Prints the tag built on its last line. Needs: debootstrap, podman (apt-get install debootstrap
# podman); pip inside the build needs PyPI.
set -euo pipefail

variant=${VARIANT:-cpu}
tag=${1:-localhost/kalos:$variant}
cache=${KALOS_IMAGE_CACHE:-/var/tmp/kalos-image-cache}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ca_bundle=${KALOS_BUILD_CA_BUNDLE-/etc/ssl/certs/ca-certificates.crt}
suite=bookworm
packages=python3,python3-venv
# The tag names what is in the base, so a change of packages makes a new base, not a stale one.
base=localhost/kalos-base:$suite-$(printf %s "$packages" | sha256sum | cut -c1-12)
tarball=$cache/$suite-minbase-${base##*-}.tar
root=$(cd "$(dirname "$0")/../.." && pwd)

for tool in debootstrap podman; do
    command -v "$tool" > /dev/null || { echo "$0: $tool not found (apt-get install debootstrap podman)" >&2; exit 2; }
done

if ! podman image exists "$base"; then
    if [ ! -s "$tarball" ]; then
        mkdir -p "$cache"
        work=$(mktemp -d "$cache/rootfs.XXXXXX")
        trap 'rm -rf "$work"' EXIT
        echo "debootstrap $suite ($packages) from $mirror" >&2
        debootstrap --variant=minbase --include="$packages" "$suite" "$work/rootfs" "$mirror" > "$work/log" \
            || { tail -n 30 "$work/log" >&2; exit 1; }
        # The package cache and lists are half the size and no use in an image.
        rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
        tar --numeric-owner -C "$work/rootfs" -cf "$work/base.tar" .
        mv "$work/base.tar" "$tarball"  # atomic: a half-written tarball is never taken as the cache
        rm -rf "$work"
        trap - EXIT
    fi
    # An imported tarball has no configuration: give it the PATH the Containerfile extends.
    podman import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' "$tarball" "$base" > /dev/null
fi

# pip in the build trusts what this host trusts (a TLS-inspecting proxy's CA, say): the bundle and
# a pip.conf naming it are mounted over paths the base already has (the system bundle, root's
# home), for the RUN steps only, so nothing of them is left in the image.
mounts=()
if [ -s "$ca_bundle" ]; then
    home=$(mktemp -d)
    trap 'rm -rf "$home"' EXIT
    mkdir -p "$home/.config/pip"
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$home/.config/pip/pip.conf"
    mounts=(-v "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro" -v "$home:/root:ro")
fi
previous=$(podman image inspect --format '{{.Id}}' "$tag" 2> /dev/null || true)
podman build --isolation chroot --pull=never "${mounts[@]}" -f "$root/deploy/container/Containerfile" \
    --build-arg PYTHON_IMAGE="$base" --build-arg VARIANT="$variant" -t "$tag" "$root" >&2
# A rebuild of a changed checkout would otherwise leave the old image and its layers behind; the
# old one goes only if nothing else names it (no tag left).
if [ -n "$previous" ] && [ "$(podman image inspect --format '{{len .RepoTags}}' "$previous")" = 0 ]; then
    podman rmi "$previous" > /dev/null 2>&1 || true
fi
echo "$tag"

#!/usr/bin/env bash
# Installs everything viotrace and its QEMU lab need on a Debian 12 / Ubuntu host, and
# prepares the lab's cache (guest kernel, initramfs, data disk, vsock backend).
# Idempotent: installs only what is missing. Needs root (or sudo) for apt.
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(qemu-system-x86 qemu-utils clang llvm libelf-dev zlib1g-dev libzstd-dev pkg-config
      busybox-static fio e2fsprogs bpftrace ca-certificates)
missing=()
for p in "${PKGS[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
SUDO=
[ "$(id -u)" = 0 ] || SUDO=sudo
if [ ${#missing[@]} -gt 0 ]; then
	echo "setup: installing ${missing[*]}"
	$SUDO apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The guest kernel is fetched with `apt-get download`, which needs fresh package lists.
if ! apt-cache show 'linux-image-6.1.0-*-cloud-amd64' >/dev/null 2>&1 \
	&& ! ls target/vm-cache/kernel-*/ok >/dev/null 2>&1; then
	$SUDO apt-get update -qq
fi

command -v cargo >/dev/null || { echo "setup: cargo (stable Rust) is required: https://rustup.rs" >&2; exit 1; }

# tracefs is where tracepoints attach.
if [ "$(id -u)" = 0 ] && ! mountpoint -q /sys/kernel/tracing 2>/dev/null; then
	mount -t tracefs none /sys/kernel/tracing 2>/dev/null || true
fi

# Lab assets: guest kernel (a Debian package, extracted, never installed), initramfs, golden disk,
# and vhost-device-vsock (cargo install into target/vm-cache/tools).
cargo run -q --release -p viotrace-vm-tests --bin viotrace-vm -- prepare

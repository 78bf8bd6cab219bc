#!/usr/bin/env bash
# Installs everything viotrace and its QEMU lab need on a Debian 12 / Ubuntu host (one apt
# call), checks afterwards that every command the project runs exists, and prepares the
# lab's cache: guest kernels, QEMU builds, initramfs, data disk, vsock backend.
# Idempotent: installs only what is missing. Needs root (or sudo) for apt.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/sbin:/sbin"

# Commands the project runs, and the Debian package that provides each.
CMDS=(
	qemu-system-x86_64:qemu-system-x86 qemu-img:qemu-utils
	clang:clang llvm-strip:llvm bpftool:bpftool bpftrace:bpftrace pkg-config:pkg-config
	busybox:busybox-static fio:fio mkfs.ext4:e2fsprogs
	debootstrap:debootstrap unshare:util-linux pivot_root:util-linux
	dpkg-deb:dpkg apt-get:apt perf:linux-perf
)
# Build dependencies (libraries) and data.
OTHER_PKGS=(libelf-dev zlib1g-dev libzstd-dev ca-certificates debian-archive-keyring)

SUDO=
[ "$(id -u)" = 0 ] || SUDO=sudo
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
version() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || true; }
candidate() { apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ { print $2 }'; }

pkgs=("${OTHER_PKGS[@]}")
for c in "${CMDS[@]}"; do pkgs+=("${c#*:}"); done
missing=()
for p in $(printf '%s\n' "${pkgs[@]}" | sort -u); do
	case "$p" in qemu-system-x86 | qemu-utils) continue ;; esac
	installed "$p" || missing+=("$p")
done
# qemu-utils must come from the same QEMU release as qemu-system-x86: a newer one (e.g. a
# bookworm-backports qemu-utils 10.0) Breaks Debian 12's qemu-system-common 7.2, and apt then
# silently REMOVES qemu-utils (qemu-img vanishes). Both are requested at one version.
qemu_pair_ok() {
	installed qemu-system-x86 && installed qemu-utils &&
		[ "$(version qemu-system-x86)" = "$(version qemu-utils)" ]
}
if [ ${#missing[@]} -gt 0 ] || ! qemu_pair_ok; then
	$SUDO apt-get update -qq
	if ! qemu_pair_ok; then
		v=$(version qemu-system-x86)
		installed qemu-system-x86 || v=$(candidate qemu-system-x86)
		if [ -z "$v" ] || [ "$v" = "(none)" ]; then
			echo "setup: apt has no qemu-system-x86 package (check /etc/apt/sources.list)" >&2
			exit 1
		fi
		missing+=("qemu-system-x86=$v" "qemu-utils=$v")
	fi
	echo "setup: installing ${missing[*]}"
	DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
		--allow-downgrades "${missing[@]}" >/dev/null
fi

# Every command the project runs must now exist.
absent=()
for c in "${CMDS[@]}"; do
	command -v "${c%%:*}" >/dev/null || absent+=("${c%%:*} (Debian package ${c#*:})")
done
command -v cargo >/dev/null || absent+=("cargo (stable Rust: https://rustup.rs)")
if [ ${#absent[@]} -gt 0 ]; then
	echo "setup: error: missing after installation:" >&2
	printf '  %s\n' "${absent[@]}" >&2
	exit 1
fi
qs=$(version qemu-system-x86)
qu=$(version qemu-utils)
if [ "$qs" != "$qu" ]; then
	echo "setup: error: qemu-system-x86 $qs and qemu-utils $qu differ (apt would remove one)" >&2
	exit 1
fi
echo "setup: all commands present (QEMU $qs)"

# tracefs is where tracepoints attach.
if [ "$(id -u)" = 0 ] && ! mountpoint -q /sys/kernel/tracing 2>/dev/null; then
	mount -t tracefs none /sys/kernel/tracing 2>/dev/null || true
fi

# Lab assets: guest kernels 5.10/6.1/6.12/7.x and QEMU 10.0 (Debian packages fetched with the
# lab's private apt lists, extracted, never installed), QEMU 11.x (a debootstrapped sid root),
# initramfs, golden disk and vhost-device-vsock (cargo install into target/vm-cache/tools).
# Building the sid root needs root; without it only the default assets are prepared.
if [ "$(id -u)" = 0 ]; then
	cargo run -q --release -p viotrace-vm-tests --bin viotrace-vm -- prepare --matrix
else
	cargo run -q --release -p viotrace-vm-tests --bin viotrace-vm -- prepare
	echo "setup: not root: the lab's QEMU 11.x root (debootstrap) is built on first use as root"
fi

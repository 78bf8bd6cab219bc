#!/bin/bash
# tb-lookups.sh OUT [DELAY [WINDOW]]: run on the host beside `viotrace-vm run`. Waits for QEMU,
# waits DELAY s (default 25: boot, the agent's start, fio's start), then counts for WINDOW s
# (default 10) every TCG translation-block hash lookup of the guest (QEMU's
# `qht_lookup_custom`: the per-vCPU jump cache missed) by guest PC, and the virtio requests
# (`virtqueue_push`). tb-lookups.py turns OUT into lookups per request by guest symbol.
# Needs a QEMU that exports both functions in .dynsym (Debian's 7.2 does) and bpftrace.
set -e
out=$1
delay=${2:-25}
window=${3:-10}
q=${QEMU:-/usr/bin/qemu-system-x86_64}
until p=$(pgrep -f qemu-system-x86 | head -1); [ -n "$p" ]; do sleep 0.5; done
sleep "$delay"
# (struct tb_desc, the lookup's `userp`, starts with the guest PC in QEMU 7.2 to 10.x)
BPFTRACE_MAP_KEYS_MAX=200000 bpftrace -e "
uprobe:$q:qht_lookup_custom /pid == $p/ { @pc[*(uint64 *)arg1] = count(); }
uprobe:$q:virtqueue_push /pid == $p/ { @push = count(); }
interval:s:$window { exit(); }" > "$out"

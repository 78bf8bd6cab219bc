// SPDX-License-Identifier: GPL-2.0
/*
 * viotrace guest object: syscall → bio → request → virtio-blk → completion.
 *
 * Loaded once. Programs are grouped by concern in the headers below:
 *   guest_core_fixes.h – kernel differences (5.10 … 7.x), resolved by CO-RE
 *   guest_common.h  – configuration (filters), maps, stats, shared helpers
 *   guest_io_summary.h – the traced syscalls; latencies of those sending no record
 *   guest_sys_pend.h – the entry of a read/write of a thread without a state,
 *                     until its file is known
 *   guest_task.h    – syscall entry/exit (raw syscall tracepoints, every mode),
 *                     per-request files of io_submit (aio_prep_rw: fentry or
 *                     kprobe)
 *   guest_rw_file.h – the file of a read/write, typed at vfs_read/vfs_write
 *   guest_uring.h   – io_uring requests' files and offsets (tracepoint, typed or raw)
 *   guest_bio.h     – bios queued/split/merged: attribution (raw_tp, every mode)
 *   guest_block.h   – requests inserted/issued/completed (raw_tp, every mode)
 *   guest_virtio.h  – virtio-blk / virtio_ring hooks: fentry/fexit ("?fentry"
 *                     optional programs) or kprobes ("?kprobe"), chosen at start
 *
 * State lives in kernel maps keyed by kernel object pointers (bio, request,
 * virtqueue) or by thread id: direct-mapped arrays first, hash maps for the
 * rest (guest_common.h). One ring buffer record per finished request and one
 * per finished syscall that is not counted in the kernel (guest_io_summary.h).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

#include "viotrace_guest.h"
#include "guest_core_fixes.h"
#include "guest_common.h"
#include "guest_io_summary.h"
#include "guest_sys_pend.h"
#include "guest_task.h"
#include "guest_rw_file.h"
#include "guest_uring.h"
#include "guest_bio.h"
#include "guest_block.h"
#include "guest_virtio.h"
#include "guest_sched.h"

char LICENSE[] SEC("license") = "GPL";

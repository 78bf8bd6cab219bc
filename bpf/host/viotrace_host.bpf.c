// SPDX-License-Identifier: GPL-2.0
/*
 * viotrace host side: follows every virtio-blk virtqueue element through QEMU
 * (stock binary, exported symbols only) and the host kernel.
 *
 * Uprobes hit per guest request (attached per QEMU process, also filtered by tgid):
 *   blk_aio_preadv/pwritev/flush/…  entry   h.submit: element state from the
 *                                           VirtIOBlockReq (opaque), merge chain via mr_next
 *   virtqueue_push                  entry   h.push, status byte, host I/O points copied in
 * Optional (--pop): virtio_blk_handle_vq entry and virtqueue_pop entry+return for h.pop.
 * Rare paths: virtio_notify (non-dataplane notification).
 * Kernel tracepoints: read/write of the virtqueue's host/guest notifier eventfds
 * (h.notify, h.irq), pread/pwrite(v), fdatasync, io_submit, io_uring submit/complete,
 * block_rq_issue/complete, sched_process_exit; for the verdicts (host_interfere.h):
 * every host block request counted per device and issuer, and run-queue waits of
 * QEMU's threads (sched_wakeup/_new, sched_switch).
 *
 * One ring-buffer record per element, emitted when the guest is notified
 * (or when the pending list of its queue overflows, or by userspace at exit).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include <bpf/usdt.bpf.h>
#include "viotrace_host.bpf.h"

#include "host_common.h"
#include "host_req.h"
#include "host_qemu.h"
#include "host_notify.h"
#include "host_interfere.h"
#include "host_io.h"

char LICENSE[] SEC("license") = "GPL";

/* SPDX-License-Identifier: GPL-2.0 */
/* Types shared between viotrace_host.bpf.c and the host agent (mirrored in host-agent/src/bpf.rs). */
#ifndef VIOTRACE_HOST_BPF_H
#define VIOTRACE_HOST_BPF_H

/* Indexes into host_rec.ts, in path order (h.notify .. h.irq). 0 = not seen. */
enum {
	HP_NOTIFY = 0,
	HP_POP,
	HP_SUBMIT,
	HP_IO_ISSUE,
	HP_DISK_ISSUE,
	HP_DISK_COMPLETE,
	HP_IO_COMPLETE,
	HP_COMPLETE_CB,
	HP_PUSH,
	HP_IRQ,
	HP_NR,
};

/* Offsets into QEMU's private structures, per traced process (value of qemu_procs). */
struct qemu_layout {
	/* VirtQueue */
	__u32 vq_queue_index;
	__u32 vq_guest_notifier_wfd; /* guest_notifier.wfd: written to interrupt the guest */
	__u32 vq_host_notifier_rfd;  /* host_notifier.rfd: read when QEMU handles a kick */
	__u32 vq_vdev;               /* VirtIODevice *vdev */
	/* VirtQueueElement (first member of VirtIOBlockReq) */
	__u32 elem_index;
	__u32 elem_out_num;
	__u32 elem_in_num;
	__u32 elem_in_sg;
	__u32 elem_out_sg;
	/* VirtIOBlockReq */
	__u32 req_dev;
	__u32 req_vq;
	__u32 req_in;
	__u32 req_out;       /* struct virtio_blk_outhdr copy */
	__u32 req_qiov_size; /* qiov.size */
	__u32 qiov_size;     /* QEMUIOVector.size */
	__u32 req_mr_next;
	__u32 req_acct_start; /* acct.start_time_ns (QEMU_CLOCK_REALTIME: CLOCK_MONOTONIC) */
	/* LuringAIOCB: offset of the io_uring_sqe copy (its addr field is at +16) */
	__u32 luring_sqe;
	/* which optional parts are valid (QL_*) */
	__u32 flags;
	/* runtime check, written by BPF: blk_aio_* requests whose queue belongs to
	 * their device (vq->vdev == req->dev) and whose does not */
	__u32 vdev_ok;
	__u32 vdev_bad;
	/* the same at virtqueue_push (push-only mode), where other devices'
	 * elements fail it too: only a warning when none ever passes */
	__u32 push_ok;
	__u32 push_bad;
};

#define QL_HAVE_NOTIFIER 1u /* notifier fds valid: h.notify/h.irq via eventfd read/write */
#define QL_HAVE_MR_NEXT 2u  /* req_mr_next valid: multireq merge followed */
#define QL_HAVE_LURING 4u   /* luring_sqe valid: io_uring I/O matched */
#define QL_HAVE_REQ_IN 8u   /* req_in valid: status byte read at push */
#define QL_NO_SUBMIT 16u    /* no blk_aio_* probes (default, or LTO): elements are taken at virtqueue_push */
/* No virtio_notify probe where QEMU (8.2+) may raise a queue's interrupt from it
 * without an eventfd (a main-loop queue): an element waits for h.irq only on a
 * queue whose guest notifier eventfd was seen written; others are emitted at
 * their push (counted as irq_untraced). */
#define QL_IRQ_LEARN 32u

/* One finished virtqueue element (ring buffer record). */
struct host_rec {
	__u64 ts[HP_NR];
	__u64 vq;       /* VirtQueue * */
	__u64 dev;      /* VirtIODevice * (VirtIOBlock) */
	__u64 merge_id; /* backend I/O id (0: never submitted) */
	__u64 sector;
	__u32 tgid;
	__u32 type;  /* virtio_blk_outhdr.type */
	__u32 bytes; /* data bytes (excluding header and status) */
	__u32 in_len;
	__u16 head;
	__u16 queue;
	__u8 status;
	__u8 has_status;
	__u8 flags; /* HR_* */
	__u8 pad;
	/* Interference (host_interfere.h): the host block device of the backend I/O
	 * (MKDEV: major << 20 | minor; 0: no block request seen), and the requests of
	 * other issuers on it: in flight when this I/O's first block request was
	 * issued, and issued while this I/O was on the device. */
	__u32 disk_dev;
	__u32 nb_inflight;
	__u32 nb_issued;
	__u32 pad2;
	__u64 nb_bytes; /* bytes of the requests of nb_issued */
};

/* Block requests of one issuing process on one device (map dev_users). */
struct dev_user {
	__u64 issued;
	__u64 completed;
	__u64 bytes;
	char comm[16];
};

/* A traced QEMU thread that waited at least WAIT_MIN_NS for a CPU (ring buffer
 * `waits`): runnable from start to end; holder: the task that kept it off the
 * CPU (see host_interfere.h). */
struct wait_rec {
	__u64 start;
	__u64 end;
	__u32 tgid;
	__u32 tid;
	__u32 holder_tgid;
	__u32 cpu;
	char comm[16];
	char holder_comm[16];
};

#define HR_HDR_FAULT 1    /* request header could not be read */
#define HR_IRQ_EVICTED 2  /* emitted without waiting for the notification (pending list full) */
#define HR_MERGED 4       /* part of a multi-request backend I/O */
#define HR_HAVE_BYTES 8   /* bytes is set */

/*
 * Counters in the stats array map: X(enum id, name in the agent's stats line,
 * description). host-agent/build.rs generates the Rust names from this table.
 */
#define VH_STATS(X)                                                                                      \
	X(ST_RINGBUF_DROP, "ringbuf_drops", record lost: ring buffer full)                                \
	X(ST_ELEMS_FULL, "elems_map_full", element not tracked: elems map full)                           \
	X(ST_IOS_FULL, "ios_map_full", backend I/O not tracked: ios map full)                             \
	X(ST_PUSHED_FULL, "pushed_map_full", pushed element lost: pushed map full)                        \
	X(ST_PENDING_EVICT, "irq_wait_evicted", emitted without h.irq: too many pushed elements waiting)  \
	X(ST_BAD_QUEUE_INDEX, "bad_queue_index", VirtQueue.queue_index out of range (layout mismatch?))   \
	X(ST_HDR_FAULT, "header_faults", request header unreadable)                                       \
	X(ST_POP_OTHER, "pop_other_device", virtqueue_pop on a non virtio-blk queue (ignored))            \
	X(ST_PUSH_UNKNOWN, "push_unknown_elem", virtqueue_push of an element we did not see popped)       \
	X(ST_SUBMIT_MERGED, "merged_elems", elements that were merged into a multi-request backend I/O)   \
	X(ST_IO_MATCHED, "host_io_matched", host I/O syscalls/SQEs matched to a backend I/O)              \
	X(ST_DISK_MATCHED, "host_disk_matched", host block requests matched)                              \
	X(ST_IRQ, "guest_notifications", guest notifications seen)                                        \
	X(ST_RECORDS, "records_emitted", records emitted)                                                 \
	X(ST_PROC_EXIT, "qemu_exits", traced QEMU processes that exited)                                  \
	X(ST_CHAIN_LONG, "merge_chain_too_long", merge chain longer than the walk limit)                  \
	X(ST_KICKS, "guest_kicks", guest kicks handled (host notifier reads))                             \
	X(ST_WAITS, "qemu_cpu_waits", QEMU thread waits for a CPU reported (>= 50 us))                    \
	X(ST_WAIT_DROP, "qemu_cpu_waits_lost", QEMU CPU wait lost: its ring buffer full)                  \
	X(ST_DEVS_FULL, "device_load_map_full", host block request not counted: device maps full)       \
	X(ST_UPROBE_HITS, "uprobe_hits", QEMU uprobe and USDT probe hits (each a trap in a QEMU thread))   \
	X(ST_PUSH_OTHER, "push_other_device", virtqueue_push of an element of another device (ignored))    \
	X(ST_NOTIFY_CALLS, "virtio_notify_calls", virtio_notify hits (synchronous guest notifications, any device)) \
	X(ST_QEMU_EXECS, "qemu_execs", processes that started a QEMU binary (discovery scans for new VMs then)) \
	X(ST_NOTIFY_TRACED, "virtio_notify_traced", virtio_notify hits on a traced virtio-blk queue)      \
	X(ST_IRQ_UNTRACED, "irq_untraced", emitted at push without h.irq: the queue notifies without an eventfd (--irq traces it))

#define VH_STAT_ENUM(id, name, desc) id,
enum {
	VH_STATS(VH_STAT_ENUM)
	ST_NR,
};
#undef VH_STAT_ENUM

#endif

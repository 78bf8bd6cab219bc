/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Records the guest BPF object sends to userspace through the ring buffer.
 * The layout is decoded field by field in guest-agent/src/raw.rs: keep both in
 * sync (the _Static_asserts pin the sizes). Counter names: VT_STATS below.
 */
#ifndef VIOTRACE_GUEST_H
#define VIOTRACE_GUEST_H

/* Point ids: identical to `Point` in shared/src/record.rs (g.* points). */
enum vt_point {
	P_SYSCALL_ENTER = 0,
	P_BIO_QUEUE = 1,
	P_RQ_INSERT = 2,
	P_QUEUE_RQ = 3,		/* the driver's queue_rq starts the request: */
	P_RQ_ISSUE = 4,		/* block_rq_issue fires inside it */
	P_VQ_ADD = 5,
	P_KICK = 6,
	P_IRQ = 7,
	P_DRIVER_COMPLETE = 8,
	P_RQ_COMPLETE = 9,
	P_BIO_COMPLETE = 10,
	P_SYSCALL_EXIT = 11,
	P_NR = 12,
};

enum vt_kind {
	K_RQ = 1,
	K_IO = 2,
};

enum vt_kick {
	KICK_UNKNOWN = 0,
	KICK_NOTIFIED = 1,
	KICK_SUPPRESSED = 2,
};

/*
 * Counters in the `stats` per-CPU array: X(ID, "name", comment). The one table
 * of them: guest-agent/build.rs turns it into the Rust names (STAT_NAMES),
 * indexed like the enum below.
 */
#define VT_STATS(X)                                                                      \
	X(S_RB_DROP_RQ, "ringbuf_drop_rq", ring buffer full: block request record lost)  \
	X(S_RB_DROP_IO, "ringbuf_drop_io", ring buffer full: syscall record lost)        \
	X(S_FULL_SYS, "map_full_syscalls", in-flight syscall map full)                   \
	X(S_FULL_BIO, "map_full_bios", bio map full)                                     \
	X(S_FULL_RQ, "map_full_requests", request map full)                              \
	X(S_FULL_VQ, "map_full_virtqueues", virtqueue map full)                          \
	X(S_FULL_ARGS, "map_full_kprobe_args", kprobe entry/return argument map full)    \
	X(S_RQ_EMITTED, "rq_emitted", request records written)                           \
	X(S_IO_EMITTED, "io_emitted", syscall records written)                           \
	X(S_BIO_QUEUED, "bio_queued", bios tracked)                                      \
	X(S_BIO_SPLIT, "bio_split", tracked bios split)                                  \
	X(S_BIO_BACKMERGE, "bio_backmerge", tracked bios back-merged)                    \
	X(S_BIO_FRONTMERGE, "bio_frontmerge", tracked bios front-merged)                 \
	X(S_RQ_MERGED, "rq_merged", request merged into another one: state dropped)      \
	X(S_RQ_REQUEUE, "rq_requeued", requests requeued)                                \
	X(S_RQ_LATE, "rq_late_emitted", completion seen: emitted only on tag reuse)      \
	X(S_REFS_TRUNC, "io_refs_truncated", requests a syscall caused beyond the 16 its record lists) \
	X(S_KICK_LOST, "kick_slot_lost", kick slot overwritten before completion)        \
	X(S_KICK_AFTER_DONE, "kick_after_completion", completed before its kick was recorded) \
	X(S_CHAIN_TRUNC, "bio_chain_truncated", request with more bios than walked)      \
	X(S_IO_SUMMARIZED, "io_summarized", syscalls counted in io_hist: no record)      \
	X(S_IO_HIST_FULL, "io_hist_full", io_hist full: the syscall sent its record)     \
	X(S_DRIVER_UNSEEN, "driver_complete_unseen", virtqueue request whose driver completion (g.driver_complete, g.irq) the kernel skipped) \
	X(S_SYS_EXIT_UNSEEN, "syscall_exit_unseen", traced syscall whose exit ran before its program was attached: no record) \
	X(S_SYS_FILE_UNSEEN, "syscall_file_unseen", read/write that succeeded without its vfs_read/vfs_write program running: no record) \
	X(S_SYS_ENTRY_LOST, "syscall_entry_lost", read/write entry of a thread without a state taken over by another thread before its file was known: not traced) \
	X(S_SYS_HASHED, "syscall_states_hashed", thread states kept in the hash map: their slot was held by another live thread) \
	X(S_RQ_ISSUE_UNSEEN, "rq_issue_unseen", virtqueue request whose block_rq_issue program did not run: no g.rq_issue; geometry read at virtqueue_add_sgs)

#define VT_STAT_ENUM(id, name, what) id,
enum vt_stat_id {
	VT_STATS(VT_STAT_ENUM)
	S_NR,
};
#undef VT_STAT_ENUM

#define VT_COMM 16
#define VT_MAX_REFS 16

struct vt_rq_event {
	__u32 kind;		/* K_RQ */
	__u32 dev;		/* major << 20 | first_minor of the disk */
	__u64 ts[P_NR];		/* CLOCK_MONOTONIC ns, 0 = not seen */
	__u64 sector;
	__u64 cgroup_id;
	__u64 inode;
	__u64 file_offset;
	__u32 bytes;
	__u32 cmd_flags;
	__u32 pid;
	__u32 tid;
	__u32 bios;
	__s32 status;		/* blk_status_t of the completion */
	__u16 queue;
	__u16 head;
	__u8 has_queue;
	__u8 has_head;
	__u8 kicked;		/* enum vt_kick */
	__u8 has_file_offset;
	char comm[VT_COMM];	/* the disk's name: userspace, from dev */
};

struct vt_rq_ref {
	__u64 sector;
	__u32 dev;
	__u32 bytes;
};

struct vt_io_event {
	__u32 kind;		/* K_IO */
	__u32 nr;		/* x86-64 syscall number */
	__u64 enter_ts;
	__u64 exit_ts;
	__s64 ret;
	__u64 bytes;
	__u64 inode;
	__u64 file_offset;
	__u64 cgroup_id;
	__u32 pid;
	__u32 tid;
	__u32 nrefs;
	__u32 refs_dropped;
	__u8 has_file_offset;
	__u8 pad[7];
	char comm[VT_COMM];
	struct vt_rq_ref refs[VT_MAX_REFS];
	/* Off-CPU time inside the syscall (guest_sched.h; 0 without it): waiting
	 * for a CPU while runnable, and blocked (sleeping: its I/O, a lock); the
	 * task that kept it off the CPU longest in one wait. */
	__u64 runq_ns;
	__u64 blocked_ns;
	__u32 holder_pid;
	__u32 pad2;
	char holder_comm[VT_COMM];
};

_Static_assert(sizeof(struct vt_rq_event) == 8 + 8 * P_NR + 32 + 24 + 4 + 4 + VT_COMM,
	       "vt_rq_event layout");
_Static_assert(sizeof(struct vt_io_event) ==
		       8 + 56 + 16 + 8 + VT_COMM + 16 * VT_MAX_REFS + 24 + VT_COMM,
	       "vt_io_event layout");

#endif

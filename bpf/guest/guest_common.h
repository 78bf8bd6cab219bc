/* SPDX-License-Identifier: GPL-2.0 */
/* Configuration, maps and helpers shared by every guest program. */
#ifndef VIOTRACE_GUEST_COMMON_H
#define VIOTRACE_GUEST_COMMON_H

/* ---- configuration, written by userspace before load (.rodata) ---- */
const volatile __u32 self_pid = 0;	/* the agent itself: never traced */
const volatile __u32 filter_pid = 0;	/* tgid, 0 = any */
const volatile __u32 filter_tid = 0;	/* 0 = any */
const volatile __u8 filter_comm_on = 0;
const volatile char filter_comm[VT_COMM] = {};
const volatile __u64 filter_cgroup = 0;	/* cgroup v2 id, 0 = any */
const volatile __u8 filter_disk_on = 0;
const volatile __s32 filter_disk_major = 0;
const volatile __s32 filter_disk_minor = 0;
/* 1: no hook after the bios end (tracepoint mode): emit at block_rq_complete. */
const volatile __u8 emit_at_rq_complete = 0;
/* 1: blk_mq_complete_request is hooked (g.driver_complete expected). */
const volatile __u8 have_driver_complete = 0;
/* 1: virtqueue_kick_prepare is hooked (g.kick; not with --skip-points g.kick):
 * requests then wait for their queue's kick. */
const volatile __u8 have_kick = 0;
/* 1: virtqueue_notify is hooked too (--exact-kick): its time replaces the kick's. */
const volatile __u8 have_notify = 0;
/* Address of vring_interrupt: irq_handler_entry's action names its vq (kprobe
 * mode's irq_entry, fentry mode's tb_irq_entry). */
const volatile __u64 vring_interrupt_addr = 0;
/* tb_irq_entry: the other virtio interrupt handlers, whose action names the
 * virtio device (a vector shared by its queues, or INTx): vp_vring_interrupt,
 * vp_interrupt, vm_interrupt (0: not in this kernel). */
const volatile __u64 vdev_irq_handlers[3] = {};
/* Wake the reader once this many bytes are pending (else it polls). */
const volatile __u64 wakeup_bytes = 256 * 1024;
/*
 * A syscall faster than this sends no record: its latency is counted in
 * `io_hist` instead (0: every syscall sends its record; see sys_summarized).
 */
const volatile __u64 io_detail_ns = 0;

/*
 * Set by userspace once aio_prep_rw's program is attached (.bss: after load):
 * io_submit's entry then leaves the iocbs to it instead of reading them twice.
 */
volatile __u8 aio_iocb_hooked = 0;

/*
 * Set by userspace once vfs_read's and vfs_write's programs are attached:
 * read, write, pread64 and pwrite64 of a thread that has a state then leave
 * the file to them (typed loads) instead of resolving the fd at entry (three
 * probe reads).
 */
volatile __u8 rw_file_hooked = 0;

/*
 * Never used: gives struct vt_io_event a place in the object's BTF (a local
 * pointer does not), so libbpf-cargo generates its Rust type for the agent's
 * ring-buffer decoding (vt_rq_event is there through rq_state).
 */
struct vt_io_event *vt_io_event_btf;

#define MAX_INFLIGHT_SYS 8192
#define MAX_BIOS 16384
#define MAX_RQS 8192
#define MAX_VQS 256
#define CHAIN_MAX 64
#define KICK_SLOTS 256
#define VT_PF_IO_WORKER 0x00000010
#define QBIOS 8

struct ident {
	__u64 cgroup_id;
	__u32 pid;
	__u32 tid;
	char comm[VT_COMM];
};

/* A syscall's file as far as it is known. */
struct sys_info {
	__u64 inode;
	__u64 offset;
	__u64 bytes;
	__u8 has_offset;
	__u8 direct;
};

/* A bio queued by a traced syscall (bio_state without what the syscall has). */
struct qbio {
	__u64 bio;		/* 0: free */
	__u64 queue_ts;
	__u64 inode;
	__u64 offset;
	__u32 has_offset;
	__u32 dev;		/* its disk (disk_dev) */
};

struct sys_state {
	struct ident id;
	__u64 enter_ts;
	__u64 inode;
	__u64 offset;
	__u64 bytes;
	__u64 dio_queued;	/* bytes of direct-I/O bios queued for `cur` so far */
	struct sys_info cur;	/* file of the request being submitted now */
	__u32 nr;
	__u8 has_offset;
	__u8 direct;
	__u8 file_pending;	/* FILE_AT_POS/FILE_AT_ARG: the file comes at vfs_read/vfs_write */
	__u8 pad;
	__u32 nrefs;
	__u32 refs_dropped;	/* requests beyond refs[] (record: requests_unlisted) */
	__u32 last_ref_dev;	/* the last request referenced (listed or not): */
	__u32 pad4;
	__u64 last_ref_sector;	/* counted once for all its bios */
	/* off-CPU accounting (guest_sched.h) */
	__u64 off_since;	/* switched out at, 0 = on CPU */
	__u64 runq_ns;
	__u64 blocked_ns;
	__u64 best_wait;	/* longest single wait for a CPU */
	__u32 cur_holder;	/* the task keeping it off the CPU now (pid) */
	__u32 best_holder;
	__u8 off_runnable;
	__u8 pad2[7];
	char cur_holder_comm[VT_COMM];
	char best_holder_comm[VT_COMM];
	/* Its bios not yet part of a request: most become one in this thread
	 * before the syscall returns, so they need no `bios` map entry. The
	 * first min(qbio_next, QBIOS) slots are this syscall's (a ring). */
	__u32 qbio_next;
	__u32 pad3;
	struct qbio qbios[QBIOS];
	/* last: a new syscall resets what comes before (nrefs says how many of
	 * these are its own) */
	struct vt_rq_ref refs[VT_MAX_REFS];
};

struct bio_state {
	struct ident id;
	__u64 queue_ts;
	__u64 inode;
	__u64 offset;
	__u64 owner_enter_ts;	/* enter ts of the owning syscall, 0 = none */
	__u32 owner_tid;
	__u8 has_offset;
	__u8 pad[3];
	__u32 dev;		/* its disk (disk_dev) */
	__u32 pad2;
};

struct rq_state {
	struct vt_rq_event ev;
	struct virtqueue *vq;	/* set at virtqueue_add_sgs */
	__u64 vdev;		/* its virtio device (fentry mode; 0: not read) */
	__u64 kick_seq;		/* vq kick sequence number at add time */
	__u64 owner_enter_ts;
	__u32 owner_tid;
	__u32 active;		/* 0: a finished use; the entry waits for the next */
	__u64 first_bio;	/* taken from the syscall's queued bios: in no map */
};

struct kick_slot {
	__u64 seq;
	__u64 ts;
	__u64 notified;
};

/*
 * The requests added since a queue's last kick, at most KICK_PEND (the others
 * take their kick from the ring alone): the kick stamps itself into each, so
 * that a request outliving KICK_SLOTS later kicks (a flush, a read the host
 * holds for seconds) still has its own.
 */
#define KICK_PEND 64

struct vq_state {
	__u64 kick_seq;
	__u64 pend_seq;		/* the kick the listed requests wait for */
	__u64 npend;		/* requests added for it (those past KICK_PEND unlisted) */
	__u64 pend[KICK_PEND];	/* struct request * */
	struct kick_slot slots[KICK_SLOTS];
};

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 20);
} events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, S_NR);
	__type(key, __u32);
	__type(value, __u64);
} stats SEC(".maps");

/*
 * Per-thread syscall state and queued bios use LRU maps: a thread that exited,
 * or a bio that ends before it becomes part of a request (REQ_NOWAIT -EAGAIN,
 * errors), would otherwise leave an entry behind forever. Eviction only hits
 * such leftovers.
 *
 * A thread's entry outlives its syscall (enter_ts = 0 between syscalls), and a
 * request's entry its use (requests are preallocated per tag: active = 0 until
 * the next use): a map update and delete per syscall and per request were the
 * costliest work of the hot path. sys_get() and rq_get() return live ones.
 */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_INFLIGHT_SYS);
	__type(key, __u32);	/* tid */
	__type(value, struct sys_state);
} sys_inflight SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_BIOS);
	__type(key, __u64);	/* struct bio * */
	__type(value, struct bio_state);
} bios SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_RQS);
	__type(key, __u64);	/* struct request * */
	__type(value, struct rq_state);
} rqs SEC(".maps");

#include "guest_keys.h"

/*
 * Latencies of the syscalls that sent no record (io_detail_ns), in the bucket
 * layout of the agent's stage histograms (shared/src/stats.rs: HDR, 2
 * significant digits): `io_hist` counts them, IO_HIST_KEY(nr, slot) → count
 * (only the slots that occur exist), and `io_sum` adds up their latencies
 * (ns) per syscall number. The agent reads both once an interval.
 */
#define IO_HIST_MAX 8192
#define IO_HIST_KEY(nr, slot) ((nr) << 16 | (slot))
#define IO_SUM_NRS 512
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, IO_HIST_MAX);
	__type(key, __u32);
	__type(value, __u64);
} io_hist SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, IO_SUM_NRS);
	__type(key, __u32);
	__type(value, __u64);
} io_sum SEC(".maps");

/*
 * Per-thread syscall states, direct-mapped first (see dm_find): thread `tid`'s
 * slot is tid % SYS_SLOTS (thread ids are small and dense), held by the first
 * thread that needed it until that thread exits (sys_thread_exit); a thread
 * whose slot another one holds uses `sys_inflight`, as all did before, and
 * counts itself in the slot's `hashed` until it exits. A thread's state is
 * looked up in about six programs per I/O; a thread without one (a socket's)
 * misses at each of its reads and writes, and looks in the hash map only when
 * `hashed` says a state of its slot may be there.
 */
#define SYS_SLOTS 1024
struct sys_slot {
	__u64 key;		/* tid, 0: free (tid 0 is the idle task) */
	__u32 hashed;		/* states of threads of this slot in sys_inflight (at most) */
	__u32 pad;
	struct sys_state s;
};

DM_TABLE(sys, SYS_SLOTS, struct sys_slot);

/* Request states, direct-mapped first; `rqs` for the rest. */
#define RQ_SLOTS 4096
struct rq_slot {
	__u64 key;		/* struct request *, 0: free */
	struct rq_state st;
};

DM_TABLE(rq, RQ_SLOTS, struct rq_slot);

/* Virtqueue states, direct-mapped first; `vqs` for the rest. A guest has a
 * few virtqueues per disk. */
#define VQ_SLOTS 64
struct vq_slot {
	__u64 key;		/* struct virtqueue *, 0: free */
	struct vq_state v;
};

DM_TABLE(vq, VQ_SLOTS, struct vq_slot);

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_VQS);
	__type(key, __u64);	/* struct virtqueue * */
	__type(value, struct vq_state);
} vqs SEC(".maps");

/*
 * What bio_queue needs of a bio's disk (the gendisk, its dev, whether it is
 * blk-mq) costs three dependent probe reads; it is the same for every bio of a
 * disk. A direct-mapped cache, keyed by the bio's device pointer (bi_bdev, or
 * bi_disk before 5.12), one per CPU: an entry's only writer is bio_queue on
 * that CPU (newer kernels skip a nested run of a program; on older ones only a
 * bio submitted from an interrupt during a refill, at most once a second per
 * entry, could interleave). An entry is refilled after DISK_TTL_NS, so a device
 * pointer reused by another disk after a hot-unplug is not believed for long.
 */
#define DISK_SLOTS 64
#define DISK_TTL_NS 1000000000ULL
struct disk_slot {
	__u64 key;
	__u64 filled_ts;
	__u32 dev;
	__u32 mq;
};
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, DISK_SLOTS);
	__type(key, __u32);
	__type(value, struct disk_slot);
} disks SEC(".maps");

/* Last buffered writer of an inode: write-back is attributed to it. A cache. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);	/* inode number */
	__type(value, struct ident);
} inode_writer SEC(".maps");

/* kprobe mode: entry argument kept for the matching kretprobe. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);	/* tid */
	__type(value, __u64);
} kick_args SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);	/* tid */
	__type(value, __u64);
} update_args SEC(".maps");

/*
 * Per-CPU stamps: a time taken by one hook for an object (a request, a
 * virtqueue), read by a later hook that runs inside it on the same CPU, so the
 * first needs no map work keyed by the object.
 *   g.queue_rq: stamped at virtio_queue_rq, taken by block_rq_issue (which
 *               fires inside it) for the same request only;
 *   g.irq:      stamped at vring_interrupt, read by blk_mq_complete_request,
 *               which the vq's callback calls inside it (hard interrupts do not
 *               nest), for a request of the same virtqueue.
 */
struct cpu_stamp {
	__u64 obj;
	__u64 ts;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct cpu_stamp);
} queue_rq_stamps SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct cpu_stamp);
} irq_stamps SEC(".maps");

/* Stamps `obj` with the time now, in this CPU's slot of `map`. */
static __always_inline void cpu_stamp_set(void *map, void *obj)
{
	__u32 zero = 0;
	struct cpu_stamp *s = bpf_map_lookup_elem(map, &zero);

	if (!s)
		return;
	s->obj = (__u64)obj;
	s->ts = bpf_ktime_get_ns();
}

/* The time stamped on this CPU for `obj`, or for `alt` (0: none), 0 if another
 * object's; with `take`, the slot is emptied. */
static __always_inline __u64 cpu_stamp_get(void *map, void *obj, __u64 alt, bool take)
{
	__u32 zero = 0;
	struct cpu_stamp *s = bpf_map_lookup_elem(map, &zero);

	if (!s || !s->obj || (s->obj != (__u64)obj && s->obj != alt))
		return 0;
	if (take)
		s->obj = 0;
	return s->ts;
}

/* Zero values used to create map entries without big stack copies. */
const struct sys_state zero_sys = {};
const struct rq_state zero_rq = {};
const struct vq_state zero_vq = {};

/* The slot of thread `tid` (its owner's tid first). */
static __always_inline struct sys_slot *sys_slot(__u32 tid, __u32 *i)
{
	*i = tid & (SYS_SLOTS - 1);
	return bpf_map_lookup_elem(&sys_slots, i);
}

/* The syscall state of thread `tid`, live or not (NULL: none yet). */
static __always_inline struct sys_state *sys_find(__u32 *tid)
{
	__u32 i;
	struct sys_slot *sl = sys_slot(*tid, &i);

	if (sl && sl->key == *tid)
		return &sl->s;
	/* No state of a thread of this slot in sys_inflight: no hash lookup (a
	 * thread that never took a state, socket or pipe I/O only, misses here
	 * at each of its syscalls). */
	if (sl && !sl->hashed)
		return NULL;
	return bpf_map_lookup_elem(&sys_inflight, tid);
}

static __always_inline struct sys_state *sys_get(__u32 *tid)
{
	struct sys_state *s = sys_find(tid);

	return s && s->enter_ts ? s : NULL;
}

/* The state of request `key`, live or not (NULL: none yet): its slot, or
 * the hash map when another request holds the slot. */
static __always_inline struct rq_state *rq_find(__u64 *key)
{
	struct rq_slot *sl = dm_find(&rq_slots, RQ_SLOTS, *key);

	return sl ? &sl->st : bpf_map_lookup_elem(&rqs, key);
}

/* The state of virtqueue `key` (NULL: none yet). */
static __always_inline struct vq_state *vq_find(__u64 *key)
{
	struct vq_slot *sl = dm_find(&vq_slots, VQ_SLOTS, *key);

	return sl ? &sl->v : bpf_map_lookup_elem(&vqs, key);
}

static __always_inline struct rq_state *rq_get(__u64 *key)
{
	struct rq_state *st = rq_find(key);

	return st && st->active ? st : NULL;
}

/* Kick time `ts` and its outcome into a request's record. */
static __always_inline void rq_set_kick(struct rq_state *st, __u64 ts, bool notified)
{
	st->ev.ts[P_KICK] = ts;
	st->ev.kicked = notified ? KICK_NOTIFIED : KICK_SUPPRESSED;
}

static __always_inline void stat_inc(__u32 id)
{
	__u64 *v = bpf_map_lookup_elem(&stats, &id);

	if (v)
		*v += 1;
}

/* map_create(), map_insert() (they count a full map with stat_inc above) */
#include "vt_maps.h"

/*
 * Counts a record about to be submitted (`id`: its kind's stat) and returns
 * the submit flags: the reader is woken only once wakeup_bytes are pending
 * (else it polls). Asked once per RB_QUERY_EVERY records of this CPU, not per
 * record: the query is a helper call, and the overshoot is at most that many
 * records.
 */
#define RB_QUERY_EVERY 32
static __always_inline __u64 rb_flags_counted(__u32 id)
{
	__u64 *v = bpf_map_lookup_elem(&stats, &id);
	__u64 n = 0;

	if (v)
		n = ++*v;
	if (n % RB_QUERY_EVERY == 0 &&
	    bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA) >= wakeup_bytes)
		return BPF_RB_FORCE_WAKEUP;
	return BPF_RB_NO_WAKEUP;
}

static __always_inline bool comm_ok(const char *comm)
{
	if (!filter_comm_on)
		return true;
#pragma unroll
	for (int i = 0; i < VT_COMM; i++) {
		if (comm[i] != filter_comm[i])
			return false;
		if (!comm[i])
			break;
	}
	return true;
}

/* Task filters, applied to the task an I/O is attributed to. */
static __always_inline bool ident_ok(const struct ident *id)
{
	if (filter_pid && id->pid != filter_pid)
		return false;
	if (filter_tid && id->tid != filter_tid)
		return false;
	if (filter_cgroup && id->cgroup_id != filter_cgroup)
		return false;
	return comm_ok(id->comm);
}

static __always_inline bool task_filter_on(void)
{
	return filter_pid || filter_tid || filter_cgroup || filter_comm_on;
}

/* A disk's dev (major << 20 | first_minor). struct gendisk has started with
 * `int major; int first_minor;` on every kernel: one read for both. */
static __always_inline __u32 disk_dev(struct gendisk *disk)
{
	struct {
		int major;
		int first_minor;
	} mm = {};

	if (bpf_core_field_offset(struct gendisk, first_minor) !=
	    bpf_core_field_offset(struct gendisk, major) + 4) {
		mm.major = BPF_CORE_READ(disk, major);
		mm.first_minor = BPF_CORE_READ(disk, first_minor);
	} else {
		bpf_probe_read_kernel(&mm, sizeof(mm),
				      (void *)disk + bpf_core_field_offset(struct gendisk, major));
	}
	return ((__u32)mm.major << 20) | (__u32)mm.first_minor;
}

/* A disk's dev passes the disk filter. */
static __always_inline bool dev_ok(__u32 dev)
{
	return !filter_disk_on ||
	       dev == (((__u32)filter_disk_major << 20) | (__u32)filter_disk_minor);
}

static __always_inline bool disk_ok(struct gendisk *disk)
{
	if (!disk)
		return false;
	/* (the filter is checked first: no read of the disk without one) */
	return !filter_disk_on || dev_ok(disk_dev(disk));
}

static __always_inline void current_ident(struct ident *id)
{
	if (bpf_core_enum_value_exists(enum bpf_func_id, BPF_FUNC_get_current_task_btf)) {
		/*
		 * 5.11+: a typed task, whose ids, cgroup and name are plain loads
		 * (what bpf_get_current_cgroup_id and bpf_get_current_comm read,
		 * without two helper calls: the syscall entry's costliest work).
		 */
		struct task_struct *t = bpf_get_current_task_btf();
		const __u64 *comm = (const __u64 *)t->comm;

		id->pid = t->tgid;
		id->tid = t->pid;
		id->cgroup_id = t->cgroups->dfl_cgrp->kn->id;
		((__u64 *)id->comm)[0] = comm[0];
		((__u64 *)id->comm)[1] = comm[1];
	} else {
		__u64 pt = bpf_get_current_pid_tgid();

		id->pid = pt >> 32;
		id->tid = (__u32)pt;
		id->cgroup_id = bpf_get_current_cgroup_id();
		bpf_get_current_comm(id->comm, sizeof(id->comm));
	}
	/* io_uring workers (iou-wrk-N, iou-sqp-N) act for their process: name it.
	 * The comm prefix is checked first: the task read only for those. */
	if (id->comm[0] == 'i' && id->comm[1] == 'o' && id->comm[2] == 'u' && id->comm[3] == '-') {
		struct task_struct *t = (struct task_struct *)bpf_get_current_task();

		if (BPF_CORE_READ(t, flags) & VT_PF_IO_WORKER)
			BPF_CORE_READ_STR_INTO(&id->comm, t, group_leader, comm);
	}
}

/*
 * cgroup owning a bio (bio->bi_blkg->blkcg->css.cgroup->kn->id); 0 if none or
 * if it is the root blkg (no parent), which is all one gets while the io
 * controller is not enabled for the writer's cgroup.
 */
static __always_inline __u64 bio_cgroup_id(struct bio *bio)
{
	if (!bpf_core_field_exists(bio->bi_blkg))
		return 0;
	struct blkcg_gq *blkg = BPF_CORE_READ(bio, bi_blkg);

	if (!blkg || !BPF_CORE_READ(blkg, parent))
		return 0;
	return BPF_CORE_READ(blkg, blkcg, css.cgroup, kn, id);
}

#endif

/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Interference measured on the host for the "why was it slow" verdicts
 * (included by viotrace_host.bpf.c after host_common.h, before host_io.h):
 *
 *  - device load: every host block request is counted per device (all issuers)
 *    and per (device, issuing process); a traced QEMU I/O snapshots the device's
 *    load of *other* issuers when its first block request is issued and when its
 *    last completes, so its record says how many other requests were in flight
 *    and how many were issued meanwhile (noisy neighbour). Userspace reads the
 *    per-process counters once a second to name the top issuers.
 *  - run-queue waits of traced QEMU threads: a thread of a traced QEMU that is
 *    woken (or preempted) and then waits at least WAIT_MIN_NS for a CPU produces
 *    one wait_rec on its own small ring buffer, with the task that kept it off
 *    the CPU: the one that preempted it, or the one running on the CPU it was
 *    woken onto (kept per CPU by the same sched_switch program). Only QEMU
 *    threads are looked at: two hash lookups per context switch for everyone
 *    else.
 *
 * Kernel differences: the request's disk (rq->q->disk 5.16+, rq->rq_disk before),
 * the task state field (__state 5.14+, state before) and the task's CPU
 * (thread_info.cpu or task->cpu), all CO-RE checked.
 */
#pragma once

#define WAIT_MIN_NS 50000ULL
#define WAIT_RB_SIZE (256 << 10)

struct dev_load {
	__u64 issued;
	__u64 completed;
	__u64 bytes; /* issued */
};

struct rq_owner {
	__u32 dev;
	__u32 tgid;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32); /* dev_t (MKDEV) */
	__type(value, struct dev_load);
} dev_loads SEC(".maps");

const struct dev_load zero_load = {};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct rq_owner); /* (dev, issuing tgid) */
	__type(value, struct dev_user);
} dev_users SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_ELEMS);
	__type(key, __u64); /* struct request * */
	__type(value, struct rq_owner);
} rq_owners SEC(".maps");

/* Who made a block request, noted where the submitter still runs (the request's
 * start, 6.5+, or its insertion into an I/O scheduler): a request may be issued
 * to the driver later from another context (kblockd, a completion). */
struct rq_origin {
	__u32 tgid;     /* the submitting process */
	__u32 qemu;     /* its traced QEMU (tid_ios), else 0 */
	__u64 merge_id; /* with qemu: the backend I/O */
	char comm[16];
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_ELEMS);
	__type(key, __u64); /* struct request * */
	__type(value, struct rq_origin);
} rq_origins SEC(".maps");

/* A traced QEMU thread waiting for a CPU. */
struct run_wait {
	__u64 since;
	__u32 holder_tgid; /* 0: not known at the start (or the idle task) */
	__u32 pad;
	char holder_comm[16];
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32); /* tid of a traced QEMU thread */
	__type(value, struct run_wait);
} runnable SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, WAIT_RB_SIZE);
} waits SEC(".maps");

/* Unused: keeps struct wait_rec in the object's BTF, so the skeleton generates
 * its Rust type (a ring buffer map carries no value type). */
struct wait_rec wait_rec_abi = {};

/* ---- kernel differences: rq_disk(), task_state_of(), task_cpu_of() ---- */

#include "vt_core_fixes.h"
#include "vt_maps.h"

static __always_inline __u32 rq_dev(struct request *rq)
{
	struct gendisk *d = rq_disk(rq);
	if (!d)
		return 0;
	__u32 major = BPF_CORE_READ(d, major), minor = BPF_CORE_READ(d, first_minor);
	return (major << 20) | (minor & 0xfffff);
}

/* ---- device load ---- */

/* Requests of issuers other than `tgid` on `dev`. */
struct others {
	__u64 issued;   /* so far */
	__u64 bytes;    /* so far */
	__u64 inflight; /* now */
};

static __always_inline struct others dev_others(__u32 dev, __u32 tgid)
{
	struct others r = {};
	struct dev_load *l = bpf_map_lookup_elem(&dev_loads, &dev);
	if (!l)
		return r;
	__u64 iss = l->issued, comp = l->completed, bytes = l->bytes;
	struct rq_owner o = { .dev = dev, .tgid = tgid };
	struct dev_user *u = bpf_map_lookup_elem(&dev_users, &o);
	if (u) {
		iss -= u->issued;
		comp -= u->completed;
		bytes -= u->bytes;
	}
	r.issued = iss;
	r.bytes = bytes;
	r.inflight = iss > comp ? iss - comp : 0;
	return r;
}

/* The other issuers' load on `dev` as host I/O `io` of QEMU `tgid` enters its
 * block layer: its first request's start (or insertion), else its first issue.
 * Taken once; block_rq_complete counts their requests issued since. From the
 * start, not the issue: a request that waits in the I/O scheduler behind a
 * neighbour's (mq-deadline) waits for exactly that load. */
static __always_inline void nb_snapshot(struct io_state *io, __u32 dev, __u32 tgid)
{
	if (io->disk_dev || !dev)
		return;
	struct others o = dev_others(dev, tgid);
	io->disk_dev = dev;
	io->nb_base = o.issued;
	io->nb_bytes_base = o.bytes;
	io->nb_inflight = o.inflight > 0xffffffff ? 0xffffffff : (__u32)o.inflight;
}

/* `start`: the request is new (block_io_start): any origin at its address is a
 * stale one's. Else an insertion, where the request may have one already (its
 * start was seen, or it is requeued and keeps its submitter): then nothing is
 * done, not even the QEMU I/O's lookup (its snapshot is taken). */
static __always_inline void note_origin(struct request *rq, bool start)
{
	__u64 k = (__u64)rq;
	if (!start && bpf_map_lookup_elem(&rq_origins, &k))
		return;
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)id;
	struct rq_origin o = { .tgid = id >> 32 };
	struct tid_io *t = bpf_map_lookup_elem(&tid_ios, &tid);
	if (t) {
		o.qemu = t->tgid;
		o.merge_id = t->merge_id;
		struct tg_ptr ik = { .tgid = t->tgid, .ptr = t->merge_id };
		struct io_state *io = bpf_map_lookup_elem(&ios, &ik);
		if (io)
			nb_snapshot(io, rq_dev(rq), t->tgid);
	}
	bpf_get_current_comm(o.comm, sizeof(o.comm));
	bpf_map_update_elem(&rq_origins, &k, &o, BPF_ANY);
}

SEC("tp_btf/block_io_start")
int BPF_PROG(rq_io_start, struct request *rq)
{
	note_origin(rq, true);
	return 0;
}

SEC("tp_btf/block_rq_insert")
int BPF_PROG(rq_insert, struct request *rq)
{
	note_origin(rq, false);
	return 0;
}

/* A request merged into another is freed without completing: its origin goes
 * with it, or the next request at its address would inherit that submitter (a
 * QEMU read dispatched from kblockd taken for fio's: counted as fio's load,
 * and matched to no QEMU I/O). */
SEC("tp_btf/block_rq_merge")
int BPF_PROG(rq_merged, struct request *rq)
{
	__u64 k = (__u64)rq;
	bpf_map_delete_elem(&rq_origins, &k);
	return 0;
}

/* Counts a block request's issue to its device. `tgid`: its traced QEMU, else
 * the submitter noted by note_origin (`o`), else the current task. Returns the
 * device. */
static __always_inline __u32 dev_issue(struct request *rq, __u32 tgid, struct rq_origin *origin)
{
	__u32 dev = rq_dev(rq);
	struct rq_owner o = { .dev = dev, .tgid = tgid };
	if (!tgid)
		o.tgid = origin ? origin->tgid : bpf_get_current_pid_tgid() >> 32;
	/* Counted once: a request the driver could not take (a full virtqueue,
	 * BLK_STS_*RESOURCE) is issued again later, and completes once. */
	__u64 k = (__u64)rq;
	if (bpf_map_update_elem(&rq_owners, &k, &o, BPF_NOEXIST))
		return dev;
	struct dev_load *l = map_create(&dev_loads, &dev, &zero_load, ST_DEVS_FULL);
	if (!l)
		return dev;
	__u64 bytes = BPF_CORE_READ(rq, __data_len);
	__sync_fetch_and_add(&l->issued, 1);
	__sync_fetch_and_add(&l->bytes, bytes);
	struct dev_user *u = bpf_map_lookup_elem(&dev_users, &o);
	if (!u) {
		struct dev_user z = {};
		if (tgid) /* a QEMU thread: the process's name, not the thread's */
			__builtin_memcpy(z.comm, "qemu", 5);
		else if (origin)
			__builtin_memcpy(z.comm, origin->comm, sizeof(z.comm));
		else
			bpf_get_current_comm(z.comm, sizeof(z.comm));
		u = map_insert(&dev_users, &o, &z, ST_DEVS_FULL);
	}
	if (u) {
		__sync_fetch_and_add(&u->issued, 1);
		__sync_fetch_and_add(&u->bytes, bytes);
	}
	return dev;
}

static __always_inline void dev_complete(struct request *rq)
{
	__u64 k = (__u64)rq;
	struct rq_owner *o = bpf_map_lookup_elem(&rq_owners, &k);
	if (!o)
		return;
	__u32 dev = o->dev;
	struct dev_load *l = bpf_map_lookup_elem(&dev_loads, &dev);
	if (l)
		__sync_fetch_and_add(&l->completed, 1);
	struct dev_user *u = bpf_map_lookup_elem(&dev_users, o);
	if (u)
		__sync_fetch_and_add(&u->completed, 1);
	bpf_map_delete_elem(&rq_owners, &k);
	bpf_map_delete_elem(&rq_origins, &k);
}

/* ---- run-queue waits of traced QEMU threads ---- */

/* The task each CPU runs (sched_switch keeps it), to name the one a woken QEMU
 * thread waits behind. */
struct cpu_task {
	__u64 task; /* struct task_struct * */
	__u32 tgid;
	__u32 pad;
};

#define MAX_CPUS 1024

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_CPUS);
	__type(key, __u32);
	__type(value, struct cpu_task);
} cpu_curr SEC(".maps");

static __always_inline int is_qemu(struct task_struct *t)
{
	__u32 tgid = BPF_CORE_READ(t, tgid);
	return bpf_map_lookup_elem(&qemu_procs, &tgid) != NULL;
}

/* A QEMU thread starts waiting for a CPU behind `holder` (tgid and task pointer;
 * 0: not known): the task that preempted it, or the one running on the CPU it
 * was woken onto. */
static __always_inline void wait_start(struct task_struct *t, __u32 holder_tgid, __u64 holder)
{
	__u32 tid = BPF_CORE_READ(t, pid);
	struct run_wait w = { .since = bpf_ktime_get_ns(), .holder_tgid = holder_tgid };
	if (holder)
		bpf_probe_read_kernel_str(&w.holder_comm, sizeof(w.holder_comm),
					  &((struct task_struct *)holder)->comm);
	bpf_map_update_elem(&runnable, &tid, &w, BPF_ANY);
}

static __always_inline void woken(struct task_struct *p)
{
	if (!is_qemu(p))
		return;
	__u32 cpu = task_cpu_of(p);
	struct cpu_task *c = bpf_map_lookup_elem(&cpu_curr, &cpu);
	wait_start(p, c ? c->tgid : 0, c ? c->task : 0);
}

SEC("tp_btf/sched_wakeup")
int BPF_PROG(qemu_wakeup, struct task_struct *p)
{
	woken(p);
	return 0;
}

SEC("tp_btf/sched_wakeup_new")
int BPF_PROG(qemu_wakeup_new, struct task_struct *p)
{
	woken(p);
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(qemu_switch, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	/* a QEMU thread switched out: preempted while runnable, it waits for a CPU
	 * from now on (held by `next`); otherwise it sleeps (a wakeup starts its
	 * next wait) */
	__u32 cpu = bpf_get_smp_processor_id();
	struct cpu_task *c = bpf_map_lookup_elem(&cpu_curr, &cpu);
	if (c) {
		c->task = (__u64)next;
		c->tgid = BPF_CORE_READ(next, tgid);
	}
	if (is_qemu(prev)) {
		__u32 ptid = BPF_CORE_READ(prev, pid);
		if (task_state_of(prev) == 0)
			wait_start(prev, BPF_CORE_READ(next, tgid), (__u64)next);
		else
			bpf_map_delete_elem(&runnable, &ptid);
	}
	if (!is_qemu(next))
		return 0;
	__u32 tid = BPF_CORE_READ(next, pid);
	struct run_wait *rw = bpf_map_lookup_elem(&runnable, &tid);
	if (!rw)
		return 0;
	__u64 start = rw->since, now = bpf_ktime_get_ns();
	if (now - start < WAIT_MIN_NS) {
		bpf_map_delete_elem(&runnable, &tid);
		return 0;
	}
	struct wait_rec *w = bpf_ringbuf_reserve(&waits, sizeof(*w), 0);
	if (!w) {
		bpf_map_delete_elem(&runnable, &tid);
		stat_inc(ST_WAIT_DROP);
		return 0;
	}
	w->start = start;
	w->end = now;
	w->tgid = BPF_CORE_READ(next, tgid);
	w->tid = tid;
	w->cpu = cpu;
	BPF_CORE_READ_STR_INTO(&w->comm, next, comm);
	/* the task noted at the wait's start; but the one that ran just before
	 * when none was noted (woken onto an idle CPU that another task took first)
	 * or when the noted one is a thread of the same QEMU while the last one is
	 * not (a sibling got the CPU first, then an outsider kept it) */
	__u32 prev_tgid = BPF_CORE_READ(prev, tgid);
	if (rw->holder_tgid && !(rw->holder_tgid == w->tgid && prev_tgid != w->tgid && prev_tgid)) {
		w->holder_tgid = rw->holder_tgid;
		__builtin_memcpy(w->holder_comm, rw->holder_comm, sizeof(w->holder_comm));
	} else {
		w->holder_tgid = prev_tgid;
		BPF_CORE_READ_STR_INTO(&w->holder_comm, prev, comm);
	}
	bpf_map_delete_elem(&runnable, &tid);
	bpf_ringbuf_submit(w, rb_flags(&waits, WAIT_RB_SIZE / 4));
	stat_inc(ST_WAITS);
	return 0;
}

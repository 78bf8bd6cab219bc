/* SPDX-License-Identifier: GPL-2.0 */
/* Limits, per-element and per-I/O state, maps, helpers, virtqueues and their notifier eventfds (included by viotrace_host.bpf.c, in this order). */
#pragma once

#define MAX_ELEMS 16384
#define MAX_SG 1024      /* iovecs summed per direction (VIRTQUEUE_MAX_SIZE) */
#define SG_CHUNK 16      /* iovecs read at once */
#define MAX_CHAIN 32     /* VIRTIO_BLK_MAX_MERGE_REQS */
#define MAX_PENDING 256 /* pushed elements waiting for a notification, per queue */
#define MAX_IOCBS 128   /* iocbs looked at per io_submit */
#define VIRTIO_BLK_OUTHDR 16
/* 1 MiB (its pages are mapped twice in the agent: 2 MiB of its RSS once written
 * through): ~5 700 records, 0.57 s at 10 000 I/Os per second; the agent is
 * woken at 256 KiB (~1 400 records, a few ms of its work: 0.4 s of ring left
 * at 10 000 I/Os per second), else it polls every second. A record that does
 * not fit is counted (ringbuf_drop). */
#define RB_SIZE (1 << 20)
#define RB_WAKE_BYTES (RB_SIZE / 4)

struct tg_ptr {
	__u32 tgid;
	__u32 pad;
	__u64 ptr;
};

#define KICK_RING 16 /* recent kicks handled, per queue */
#define PUSH_RING 64 /* recent pushes, per queue */

struct vq_state {
	__u64 dev;
	__u64 last_kick;
	__u64 push_seq;  /* next sequence number for a pushed element */
	__u64 flush_seq; /* first pushed element not yet emitted */
	__u16 queue;
	__u8 irq_by_fd; /* its guest notifier eventfd was written (QL_IRQ_LEARN) */
	__u8 pad;
	__s32 kick_fd; /* host notifier rfd seen at registration */
	/* push-only mode: an element's h.notify is found at its push from its
	 * h.submit (the latest kick before it, if no push came in between) */
	__u32 kick_n;
	__u32 push_n;
	__u64 kicks[KICK_RING];
	__u64 pushes[PUSH_RING];
};

static struct vq_state vq_zero;

struct fd_key {
	__u32 tgid;
	__s32 fd;
};

struct fd_val {
	__u64 vq;
	__u32 kind; /* FD_KICK or FD_IRQ */
	__u32 pad;
};

#define FD_KICK 1
#define FD_IRQ 2

struct pushed_key {
	__u32 tgid;
	__u32 pad;
	__u64 vq;
	__u64 seq;
};

struct io_state {
	__u64 ts[HP_NR]; /* only the host I/O points are used */
	__u64 buf;
	__u32 refs;
	__u32 pad; /* 1: tracked from its syscall (QL_NO_SUBMIT), not from blk_aio_* */
	/* device load of other issuers (host_interfere.h) */
	__u32 disk_dev;
	__u32 nb_inflight;
	__u64 nb_base; /* their requests issued before this I/O entered the block layer */
	__u64 nb_bytes_base; /* and their bytes */
	__u64 nb_bytes;
	__u32 nb_issued;
	__u32 pad2;
};

struct tid_io {
	__u32 tgid;
	__u32 pad;
	__u64 merge_id;
};


struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 256);
	__type(key, __u32); /* tgid */
	__type(value, struct qemu_layout);
} qemu_procs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct tg_ptr); /* VirtQueue * */
	__type(value, struct vq_state);
} vqs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32); /* tid */
	__type(value, __u64); /* VirtQueue * */
} pop_arg SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_ELEMS);
	__type(key, struct tg_ptr); /* VirtQueueElement * == VirtIOBlockReq * */
	__type(value, struct host_rec);
} elems SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_ELEMS);
	__type(key, struct pushed_key);
	__type(value, struct host_rec);
} pushed SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_ELEMS);
	__type(key, struct tg_ptr); /* ptr = merge id */
	__type(value, struct io_state);
} ios SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_ELEMS);
	__type(key, struct tg_ptr); /* ptr = first data buffer (0: flush) */
	__type(value, __u64);       /* merge id */
} io_by_buf SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32); /* tid inside a matched I/O syscall */
	__type(value, struct tid_io);
} tid_ios SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_ELEMS);
	__type(key, __u64); /* struct request * */
	__type(value, struct tid_io);
} rq_ios SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_ELEMS);
	__type(key, __u64); /* io_uring user_data (LuringAIOCB *) */
	__type(value, struct tid_io);
} uring_ios SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, struct fd_key);
	__type(value, struct fd_val);
} notifier_fds SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, ST_NR);
	__type(key, __u32);
	__type(value, __u64);
} stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, RB_SIZE);
} events SEC(".maps");

/* scratch for building a record (too big for the stack together with loops):
 * SCRATCH_BUILD for one about to be stored in `elems`, SCRATCH_PUSH for the
 * element being pushed when it was first seen at its push (it goes straight to
 * `pushed` or the ring buffer, without a round trip through `elems`). */
#define SCRATCH_BUILD 0
#define SCRATCH_PUSH 1
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, struct host_rec);
} scratch SEC(".maps");

__u64 next_merge_id = 0;

static __always_inline void stat_inc(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&stats, &idx);
	if (v)
		__sync_fetch_and_add(v, 1);
}

static __always_inline struct qemu_layout *this_proc(__u32 *tgid)
{
	*tgid = bpf_get_current_pid_tgid() >> 32;
	return bpf_map_lookup_elem(&qemu_procs, tgid);
}

static __always_inline __u64 read_u64(__u64 addr)
{
	__u64 v = 0;
	bpf_probe_read_user(&v, sizeof(v), (void *)addr);
	return v;
}

static __always_inline __u32 read_u32(__u64 addr)
{
	__u32 v = 0;
	bpf_probe_read_user(&v, sizeof(v), (void *)addr);
	return v;
}

/* The flags of a ring-buffer submit: no wakeup per record (the agent polls
 * every second; a wakeup costs the traced QEMU thread an irq_work), only once
 * more than `wake_at` bytes wait. */
static __always_inline __u64 rb_flags(void *rb, __u64 wake_at)
{
	return bpf_ringbuf_query(rb, BPF_RB_AVAIL_DATA) > wake_at ? BPF_RB_FORCE_WAKEUP
								  : BPF_RB_NO_WAKEUP;
}

static __always_inline void emit(struct host_rec *r)
{
	if (bpf_ringbuf_output(&events, r, sizeof(*r), rb_flags(&events, RB_WAKE_BYTES))) {
		stat_inc(ST_RINGBUF_DROP);
		return;
	}
	stat_inc(ST_RECORDS);
}

/* ---- virtqueues and their notifier eventfds ---- */

static __always_inline void fd_register(__u32 tgid, __s32 fd, __u64 vq, __u32 kind)
{
	if (fd < 0)
		return;
	struct fd_key k = { .tgid = tgid, .fd = fd };
	struct fd_val v = { .vq = vq, .kind = kind };
	bpf_map_update_elem(&notifier_fds, &k, &v, BPF_ANY);
}

static __always_inline __s32 read_fd(__u64 addr)
{
	__s32 fd = -1;
	if (bpf_probe_read_user(&fd, sizeof(fd), (void *)addr))
		return -1;
	return fd;
}

/* Finds or registers a virtio-blk VirtQueue (and its notifier fds). */
static __always_inline struct vq_state *vq_get(struct qemu_layout *l, __u32 tgid, __u64 vq, __u64 dev)
{
	struct tg_ptr k = { .tgid = tgid, .ptr = vq };
	struct vq_state *st = bpf_map_lookup_elem(&vqs, &k);
	if (st || !vq)
		return st;
	__u16 qi = 0xffff;
	__s32 kick_fd = -1;
	bpf_probe_read_user(&qi, sizeof(qi), (void *)(vq + l->vq_queue_index));
	if (qi >= 1024) { /* VIRTIO_QUEUE_MAX */
		stat_inc(ST_BAD_QUEUE_INDEX);
		qi = 0xffff;
	}
	if (l->flags & QL_HAVE_NOTIFIER) {
		kick_fd = read_fd(vq + l->vq_host_notifier_rfd);
		fd_register(tgid, kick_fd, vq, FD_KICK);
		fd_register(tgid, read_fd(vq + l->vq_guest_notifier_wfd), vq, FD_IRQ);
	}
	/* (too large for the stack: created zeroed, then filled in) */
	bpf_map_update_elem(&vqs, &k, &vq_zero, BPF_NOEXIST);
	st = bpf_map_lookup_elem(&vqs, &k);
	if (st && !st->dev) {
		st->dev = dev;
		st->queue = qi;
		st->kick_fd = kick_fd;
	}
	return st;
}

/* A kick handled on the queue (h.notify of the requests it brings). */
static __always_inline void vq_kick(struct vq_state *st, __u64 now)
{
	st->last_kick = now;
	st->kicks[st->kick_n++ & (KICK_RING - 1)] = now;
}

struct notify_find {
	struct vq_state *st;
	__u64 submit;
	__u64 push;  /* latest push before submit */
	__u64 kick;  /* latest kick at or before submit */
	__u32 empty; /* the walk reached a slot never written */
};

/* Newest push first (a queue's pushes are recorded in time order): the walk
 * ends at the first push before submit, the latest one. It keeps no count of
 * the pushes it passed: a count is a known constant that differs in every
 * iteration, and a verifier that marks a branch on it precise (6.18.44 does:
 * `count >= PUSH_RING`) then explores the rest of the program once per
 * iteration (1 M instructions, too large to load). */
static long push_before(__u64 i, void *data)
{
	struct notify_find *f = data;
	if (!f->st)
		return 1;
	__u64 t = f->st->pushes[(f->st->push_n - 1 - i) & (PUSH_RING - 1)];
	if (!t) {
		f->empty = 1;
		return 1;
	}
	if (t < f->submit) {
		f->push = t;
		return 1;
	}
	return 0;
}

/* The kick that brought a request QEMU took at `submit`: the latest kick at
 * or before it, unless a push came in between (then QEMU found the request by
 * polling the ring: no h.notify). 0 when the rings no longer tell. */
static __always_inline __u64 vq_notify_of(struct vq_state *st, __u64 submit)
{
	struct notify_find f = { .st = st, .submit = submit };
	if (!submit)
		return 0;
	bpf_loop(PUSH_RING, push_before, &f, 0);
	/* every recorded push came after submit and the ring wrapped: unknown */
	if (!f.push && !f.empty)
		return 0;
	for (int i = 0; i < KICK_RING; i++) {
		__u64 t = st->kicks[i];
		if (t && t <= submit && t > f.kick)
			f.kick = t;
	}
	return f.kick > f.push ? f.kick : 0;
}


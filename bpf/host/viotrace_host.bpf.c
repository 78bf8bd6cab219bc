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
 * block_rq_issue/complete, sched_process_exit.
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

char LICENSE[] SEC("license") = "GPL";

#define MAX_ELEMS 16384
#define MAX_SG 1024      /* iovecs summed per direction (VIRTQUEUE_MAX_SIZE) */
#define SG_CHUNK 16      /* iovecs read at once */
#define MAX_CHAIN 32     /* VIRTIO_BLK_MAX_MERGE_REQS */
#define MAX_PENDING 256
#define MAX_IOCBS 128   /* iocbs looked at per io_submit */  /* pushed elements waiting for a notification, per queue */
#define VIRTIO_BLK_OUTHDR 16
#define RB_SIZE (4 << 20)
#define RB_WAKE_BYTES (RB_SIZE / 4)

struct tg_ptr {
	__u32 tgid;
	__u32 pad;
	__u64 ptr;
};

struct vq_state {
	__u64 dev;
	__u64 last_kick;
	__u64 push_seq;  /* next sequence number for a pushed element */
	__u64 flush_seq; /* first pushed element not yet emitted */
	__u16 queue;
	__u16 pad;
	__s32 kick_fd; /* host notifier rfd seen at registration */
};

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

/* scratch for building a record (too big for the stack together with loops) */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
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

static __always_inline void emit(struct host_rec *r)
{
	/* No wakeup per record (the agent polls every 100 ms): a wakeup costs the
	 * traced QEMU thread an irq_work; wake the agent early only when the ring
	 * fills up. */
	__u64 fl = bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA) > RB_WAKE_BYTES ? BPF_RB_FORCE_WAKEUP
										 : BPF_RB_NO_WAKEUP;
	if (bpf_ringbuf_output(&events, r, sizeof(*r), fl)) {
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
	struct vq_state n = { .dev = dev, .kick_fd = -1 };
	__u16 qi = 0xffff;
	bpf_probe_read_user(&qi, sizeof(qi), (void *)(vq + l->vq_queue_index));
	if (qi >= 1024) { /* VIRTIO_QUEUE_MAX */
		stat_inc(ST_BAD_QUEUE_INDEX);
		qi = 0xffff;
	}
	n.queue = qi;
	if (l->flags & QL_HAVE_NOTIFIER) {
		n.kick_fd = read_fd(vq + l->vq_host_notifier_rfd);
		fd_register(tgid, n.kick_fd, vq, FD_KICK);
		fd_register(tgid, read_fd(vq + l->vq_guest_notifier_wfd), vq, FD_IRQ);
	}
	bpf_map_update_elem(&vqs, &k, &n, BPF_NOEXIST);
	return bpf_map_lookup_elem(&vqs, &k);
}

/* ---- QEMU uprobes ---- */

/* --pop only: registers the queue before its first element is popped. */
SEC("uprobe")
int BPF_KPROBE(handle_vq, void *s, void *vq)
{
	__u32 tgid;
	struct qemu_layout *l = this_proc(&tgid);
	if (!l)
		return 0;
	struct vq_state *st = vq_get(l, tgid, (__u64)vq, (__u64)s);
	if (st && !(l->flags & QL_HAVE_NOTIFIER))
		st->last_kick = bpf_ktime_get_ns();
	return 0;
}

SEC("uprobe")
int BPF_KPROBE(pop_enter, void *vq)
{
	__u32 tgid;
	if (!this_proc(&tgid))
		return 0;
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	__u64 v = (__u64)vq;
	bpf_map_update_elem(&pop_arg, &tid, &v, BPF_ANY);
	return 0;
}

struct sg_chunk {
	__u64 v[SG_CHUNK * 4]; /* struct iovec: iov_base, iov_len; twice SG_CHUNK so that
				  the masked read size below is in bounds */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct sg_chunk);
} sg_buf SEC(".maps");

/* Total length of a QEMU scatter list (n struct iovec at sg), read SG_CHUNK at a
 * time: a 64 KiB request from scattered guest pages has 17+ in-iovecs. A global
 * function, verified once. */
__noinline __u32 sg_bytes(__u64 sg, __u32 n)
{
	__u32 z = 0;
	struct sg_chunk *b = bpf_map_lookup_elem(&sg_buf, &z);
	__u32 total = 0;
	if (!b)
		return 0;
	if (n > MAX_SG)
		n = MAX_SG;
	for (__u32 base = 0; base < MAX_SG; base += SG_CHUNK) {
		if (base >= n)
			break;
		__u32 k = n - base;
		if (k > SG_CHUNK)
			k = SG_CHUNK;
		__u64 sz = (__u64)k * 16; /* ≤ 256; the mask below is for the verifier, after */
		asm volatile("" : "+r"(sz)); /* a barrier that keeps clang from dropping it */
		sz &= 0x1ff;
		if (bpf_probe_read_user(b->v, sz, (void *)(sg + (__u64)base * 16)))
			break;
		for (__u32 i = 0; i < SG_CHUNK; i++) {
			if (i >= k)
				break;
			total += (__u32)b->v[i * 2 + 1];
		}
	}
	return total;
}

/* The fields every record gets from the element itself (VirtIOBlockReq). */
static __always_inline void rec_init(struct host_rec *r, struct qemu_layout *l, __u32 tgid,
				     __u64 e, __u64 vq, struct vq_state *st)
{
	__builtin_memset(r, 0, sizeof(*r));
	r->ts[HP_NOTIFY] = st->last_kick;
	r->tgid = tgid;
	r->vq = vq;
	r->dev = st->dev;
	r->queue = st->queue;
	r->head = (__u16)read_u32(e + l->elem_index);
}

/* An element popped from a queue (h.pop, sizes from its scatter lists). */
static __always_inline int pop_done(struct qemu_layout *l, __u32 tgid, __u64 vq, __u64 e)
{
	struct tg_ptr vk = { .tgid = tgid, .ptr = vq };
	struct vq_state *st = bpf_map_lookup_elem(&vqs, &vk);
	if (!st) {
		stat_inc(ST_POP_OTHER);
		return 0;
	}
	__u32 z = 0;
	struct host_rec *r = bpf_map_lookup_elem(&scratch, &z);
	if (!r)
		return 0;
	rec_init(r, l, tgid, e, vq, st);
	r->ts[HP_POP] = bpf_ktime_get_ns();
	__u32 out_num = read_u32(e + l->elem_out_num);
	__u32 in_num = read_u32(e + l->elem_in_num);
	__u64 out_sg = read_u64(e + l->elem_out_sg);
	__u64 in_sg = read_u64(e + l->elem_in_sg);
	struct {
		__u32 type;
		__u32 ioprio;
		__u64 sector;
	} hdr = {};
	__u64 hdr_addr = out_num ? read_u64(out_sg) : 0;
	if (!hdr_addr || bpf_probe_read_user(&hdr, sizeof(hdr), (void *)hdr_addr)) {
		stat_inc(ST_HDR_FAULT);
		r->flags |= HR_HDR_FAULT;
	}
	r->type = hdr.type;
	r->sector = hdr.sector;
	__u32 out_b = sg_bytes(out_sg, out_num);
	__u32 in_b = sg_bytes(in_sg, in_num);
	out_b = out_b > VIRTIO_BLK_OUTHDR ? out_b - VIRTIO_BLK_OUTHDR : 0;
	in_b = in_b > 1 ? in_b - 1 : 0; /* status byte */
	r->bytes = out_b + in_b;
	r->flags |= HR_HAVE_BYTES;
	struct tg_ptr ek = { .tgid = tgid, .ptr = e };
	if (bpf_map_update_elem(&elems, &ek, r, BPF_ANY))
		stat_inc(ST_ELEMS_FULL);
	return 0;
}


SEC("uretprobe")
int BPF_KRETPROBE(pop_ret, void *ret)
{
	__u32 tgid;
	struct qemu_layout *l = this_proc(&tgid);
	if (!l)
		return 0;
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	__u64 *vqp = bpf_map_lookup_elem(&pop_arg, &tid);
	if (!vqp)
		return 0;
	__u64 vq = *vqp;
	bpf_map_delete_elem(&pop_arg, &tid);
	if (!ret)
		return 0;
	return pop_done(l, tgid, vq, (__u64)ret);
}

/* The same from QEMU's trace point (USDT qemu:virtqueue_pop, dtrace-backend builds
 * such as Fedora's and RHEL's): one trap per element instead of two. */
SEC("usdt")
int BPF_USDT(usdt_pop, void *vq, void *elem, unsigned int in_num, unsigned int out_num)
{
	__u32 tgid;
	struct qemu_layout *l = this_proc(&tgid);
	if (!l || !elem)
		return 0;
	return pop_done(l, tgid, (__u64)vq, (__u64)elem);
}

/*
 * Element state from a VirtIOBlockReq seen for the first time at submit or push
 * (default mode: no virtqueue_pop probe). The header comes from the request's
 * own copy (req->out). Returns the tracked state or NULL.
 */
static __always_inline struct host_rec *elem_from_req(struct qemu_layout *l, __u32 tgid, __u64 req,
						      int create_vq, int at_push)
{
	struct tg_ptr ek = { .tgid = tgid, .ptr = req };
	struct host_rec *r = bpf_map_lookup_elem(&elems, &ek);
	if (r)
		return r;
	__u64 vq = read_u64(req + l->req_vq);
	struct vq_state *st;
	if (create_vq) {
		/* blk_aio_* serve every device model: a VirtIOBlockReq's queue belongs
		 * to the request's device (vq->vdev == req->dev). */
		__u64 dev = read_u64(req + l->req_dev);
		/* Counted for the runtime check at submit only: every virtio device
		 * pushes through virtqueue_push, other block devices rarely use blk_aio_*. */
		if (!vq || !dev || read_u64(vq + l->vq_vdev) != dev) {
			if (!at_push)
				__sync_fetch_and_add(&l->vdev_bad, 1);
			return NULL;
		}
		if (!at_push)
			__sync_fetch_and_add(&l->vdev_ok, 1);
		st = vq_get(l, tgid, vq, dev);
	} else {
		struct tg_ptr vk = { .tgid = tgid, .ptr = vq };
		st = bpf_map_lookup_elem(&vqs, &vk);
	}
	if (!st)
		return NULL;
	__u32 z = 0;
	r = bpf_map_lookup_elem(&scratch, &z);
	if (!r)
		return NULL;
	rec_init(r, l, tgid, req, vq, st);
	struct {
		__u32 type;
		__u32 ioprio;
		__u64 sector;
	} hdr = {};
	if (bpf_probe_read_user(&hdr, sizeof(hdr), (void *)(req + l->req_out))) {
		stat_inc(ST_HDR_FAULT);
		r->flags |= HR_HDR_FAULT;
	}
	r->type = hdr.type;
	r->sector = hdr.sector;
	if (at_push) {
		/* no blk_aio_* probe (LTO): the sizes from the element's scatter lists,
		 * restored by QEMU before the push */
		__u32 out_b = sg_bytes(read_u64(req + l->elem_out_sg), read_u32(req + l->elem_out_num));
		__u32 in_b = sg_bytes(read_u64(req + l->elem_in_sg), read_u32(req + l->elem_in_num));
		out_b = out_b > VIRTIO_BLK_OUTHDR ? out_b - VIRTIO_BLK_OUTHDR : 0;
		in_b = in_b > 1 ? in_b - 1 : 0;
		r->bytes = out_b + in_b;
		r->flags |= HR_HAVE_BYTES;
	}
	if (bpf_map_update_elem(&elems, &ek, r, BPF_ANY)) {
		stat_inc(ST_ELEMS_FULL);
		return NULL;
	}
	return bpf_map_lookup_elem(&elems, &ek);
}

struct chain_ctx {
	struct qemu_layout *l;
	__u32 tgid;
	__u32 n;
	__u8 merged;
	__u8 follow;
	__u16 pad;
	__u32 pad2;
	__u64 req;
	__u64 id;
	__u64 now;
	__u64 other_bytes; /* data bytes of all but the first request */
};

static long chain_one(__u64 i, void *data)
{
	struct chain_ctx *c = data;
	struct qemu_layout *l = c->l;
	if (!l)
		return 1;
	struct host_rec *r = elem_from_req(l, c->tgid, c->req, 1, 0);
	if (r) {
		r->ts[HP_SUBMIT] = c->now;
		r->merge_id = c->id;
		if (c->merged)
			r->flags |= HR_MERGED;
		if (i > 0) {
			/* a merged-in request keeps its own qiov */
			__u32 b = (__u32)read_u64(c->req + l->req_qiov_size);
			c->other_bytes += b;
			if (!(r->flags & HR_HAVE_BYTES)) {
				r->bytes = b;
				r->flags |= HR_HAVE_BYTES;
			}
		}
		c->n++;
	}
	if (!c->follow)
		return 1;
	c->req = read_u64(c->req + l->req_mr_next);
	return c->req ? 0 : 1;
}

/*
 * A backend request for opaque (the first VirtIOBlockReq of a possibly merged
 * chain). size: bytes of the backend request (merged qiov), or -1 when the
 * request has no data (flush) or its size is the given range (discard).
 */
static __always_inline int on_submit(void *opaque_p, __u64 buf, int has_buf, __s64 size)
{
	__u32 tgid;
	struct qemu_layout *l = this_proc(&tgid);
	if (!l)
		return 0;
	__u64 opaque = (__u64)opaque_p;
	/* Only virtio-blk requests: the request's vq must be a virtio-blk queue we
	 * know, or its dev the VirtIOBlock of one (first request of a device). */
	struct host_rec *first = elem_from_req(l, tgid, opaque, 1, 0);
	if (!first)
		return 0;
	struct chain_ctx c = {
		.l = l,
		.tgid = tgid,
		.follow = (l->flags & QL_HAVE_MR_NEXT) ? 1 : 0,
		.req = opaque,
		.now = bpf_ktime_get_ns(),
	};
	c.id = __sync_fetch_and_add(&next_merge_id, 1) + 1;
	if (c.follow && read_u64(opaque + l->req_mr_next))
		c.merged = 1;
	bpf_loop(MAX_CHAIN, chain_one, &c, 0);
	if (c.req && c.follow)
		stat_inc(ST_CHAIN_LONG);
	struct tg_ptr ek = { .tgid = tgid, .ptr = opaque };
	first = bpf_map_lookup_elem(&elems, &ek);
	if (first && !(first->flags & HR_HAVE_BYTES)) {
		__u64 b = size >= 0 ? (__u64)size : 0;
		first->bytes = b > c.other_bytes ? (__u32)(b - c.other_bytes) : 0;
		first->flags |= HR_HAVE_BYTES;
	}
	if (c.merged) {
		__u32 idx = ST_SUBMIT_MERGED;
		__u64 *v = bpf_map_lookup_elem(&stats, &idx);
		if (v)
			__sync_fetch_and_add(v, c.n);
	}
	struct io_state io = { .refs = c.n, .buf = buf };
	struct tg_ptr ik = { .tgid = tgid, .ptr = c.id };
	if (bpf_map_update_elem(&ios, &ik, &io, BPF_ANY)) {
		stat_inc(ST_IOS_FULL);
		return 0;
	}
	if (has_buf) {
		struct tg_ptr bk = { .tgid = tgid, .ptr = buf };
		bpf_map_update_elem(&io_by_buf, &bk, &c.id, BPF_ANY);
	}
	return 0;
}

SEC("uprobe")
int BPF_KPROBE(submit_rw, void *blk, __s64 offset, void *qiov, int flags, void *cb, void *opaque)
{
	__u64 q = (__u64)qiov;
	__u64 iov = read_u64(q); /* QEMUIOVector.iov */
	__u64 buf = iov ? read_u64(iov) : 0;
	__u32 tgid;
	struct qemu_layout *l = this_proc(&tgid);
	if (!l)
		return 0;
	__s64 size = (__s64)read_u64(q + l->qiov_size);
	return on_submit(opaque, buf, 1, size);
}

SEC("uprobe")
int BPF_KPROBE(submit_flush, void *blk, void *cb, void *opaque)
{
	return on_submit(opaque, 0, 1, -1);
}

SEC("uprobe")
int BPF_KPROBE(submit_discard, void *blk, __s64 offset, __s64 bytes, void *cb, void *opaque)
{
	return on_submit(opaque, 0, 0, bytes);
}

SEC("uprobe")
int BPF_KPROBE(submit_wzeroes, void *blk, __s64 offset, __s64 bytes, int flags, void *cb, void *opaque)
{
	return on_submit(opaque, 0, 0, bytes);
}

static __always_inline void io_release(__u32 tgid, __u64 id, struct host_rec *r)
{
	struct tg_ptr ik = { .tgid = tgid, .ptr = id };
	struct io_state *io = bpf_map_lookup_elem(&ios, &ik);
	if (!io)
		return;
	r->ts[HP_IO_ISSUE] = io->ts[HP_IO_ISSUE];
	r->ts[HP_DISK_ISSUE] = io->ts[HP_DISK_ISSUE];
	r->ts[HP_DISK_COMPLETE] = io->ts[HP_DISK_COMPLETE];
	r->ts[HP_IO_COMPLETE] = io->ts[HP_IO_COMPLETE];
	if (io->refs > 1) {
		io->refs--;
		return;
	}
	struct tg_ptr bk = { .tgid = tgid, .ptr = io->buf };
	__u64 *cur = bpf_map_lookup_elem(&io_by_buf, &bk);
	if (cur && *cur == id)
		bpf_map_delete_elem(&io_by_buf, &bk);
	bpf_map_delete_elem(&ios, &ik);
}

SEC("uprobe")
int BPF_KPROBE(push, void *vq, void *elem, unsigned int len)
{
	__u32 tgid;
	struct qemu_layout *l = this_proc(&tgid);
	if (!l)
		return 0;
	struct tg_ptr vk = { .tgid = tgid, .ptr = (__u64)vq };
	struct vq_state *st = bpf_map_lookup_elem(&vqs, &vk);
	int at_push = (l->flags & QL_NO_SUBMIT) ? 1 : 0;
	if (!st && !at_push)
		return 0; /* not a virtio-blk queue (yet) */
	struct tg_ptr ek = { .tgid = tgid, .ptr = (__u64)elem };
	/* without blk_aio_* probes the element is first seen here (its queue too) */
	struct host_rec *r = elem_from_req(l, tgid, (__u64)elem, at_push, at_push);
	if (!r) {
		if (st)
			stat_inc(ST_PUSH_UNKNOWN);
		return 0;
	}
	if (!st) {
		st = bpf_map_lookup_elem(&vqs, &vk);
		if (!st)
			return 0;
	}
	r->ts[HP_PUSH] = bpf_ktime_get_ns();
	r->in_len = len;
	/* A kick's requests are all taken before the queue's next completion on this
	 * thread: later requests did not come from that kick (e.g. an iothread that
	 * polls the ring instead of reading the eventfd) and get no h.notify. */
	st->last_kick = 0;
	if (l->flags & QL_HAVE_REQ_IN) {
		__u64 in = read_u64((__u64)elem + l->req_in);
		if (in && !bpf_probe_read_user(&r->status, 1, (void *)in))
			r->has_status = 1;
	}
	if (at_push && !r->merge_id) {
		/* fallback: the host I/O whose first buffer is the element's first data
		 * buffer (reads: in_sg[0]; writes: after the 16-byte header in out_sg) */
		__u64 buf = 0;
		if (r->type == 0) {
			buf = read_u64(read_u64((__u64)elem + l->elem_in_sg));
		} else if (r->type == 1) {
			__u64 sg = read_u64((__u64)elem + l->elem_out_sg);
			__u64 len0 = read_u64(sg + 8);
			buf = len0 > VIRTIO_BLK_OUTHDR ? read_u64(sg) + VIRTIO_BLK_OUTHDR
						       : read_u64(sg + 16);
		}
		struct tg_ptr bk = { .tgid = tgid, .ptr = buf };
		__u64 *mid = bpf_map_lookup_elem(&io_by_buf, &bk);
		if (mid && (buf || r->type == 4))
			r->merge_id = *mid;
	}
	if (r->merge_id)
		io_release(tgid, r->merge_id, r);

	if (!(l->flags & QL_HAVE_NOTIFIER)) {
		emit(r);
		bpf_map_delete_elem(&elems, &ek);
		return 0;
	}
	/* notifier fds change when the guest resets the device: follow them */
	__s32 kfd = read_fd((__u64)vq + l->vq_host_notifier_rfd);
	if (kfd != st->kick_fd) {
		st->kick_fd = kfd;
		fd_register(tgid, kfd, (__u64)vq, FD_KICK);
		fd_register(tgid, read_fd((__u64)vq + l->vq_guest_notifier_wfd), (__u64)vq, FD_IRQ);
	}
	struct pushed_key pk = { .tgid = tgid, .vq = (__u64)vq, .seq = st->push_seq };
	if (bpf_map_update_elem(&pushed, &pk, r, BPF_ANY)) {
		stat_inc(ST_PUSHED_FULL);
		emit(r);
		bpf_map_delete_elem(&elems, &ek);
		return 0;
	}
	st->push_seq++;
	bpf_map_delete_elem(&elems, &ek);
	if (st->push_seq - st->flush_seq > MAX_PENDING) {
		/* notifications suppressed for too long: emit the oldest without h.irq */
		pk.seq = st->flush_seq;
		struct host_rec *old = bpf_map_lookup_elem(&pushed, &pk);
		if (old) {
			old->flags |= HR_IRQ_EVICTED;
			emit(old);
			bpf_map_delete_elem(&pushed, &pk);
		}
		st->flush_seq++;
		stat_inc(ST_PENDING_EVICT);
	}
	return 0;
}

struct flush_ctx {
	__u32 tgid;
	__u64 vq;
	__u64 seq;
	__u64 now;
};

static long flush_one(__u64 i, void *data)
{
	struct flush_ctx *c = data;
	struct pushed_key pk = { .tgid = c->tgid, .vq = c->vq, .seq = c->seq + i };
	struct host_rec *r = bpf_map_lookup_elem(&pushed, &pk);
	if (r) {
		r->ts[HP_IRQ] = c->now;
		emit(r);
		bpf_map_delete_elem(&pushed, &pk);
	}
	return 0;
}

static __always_inline void flush_vq(__u32 tgid, __u64 vq)
{
	struct tg_ptr vk = { .tgid = tgid, .ptr = vq };
	struct vq_state *st = bpf_map_lookup_elem(&vqs, &vk);
	if (!st)
		return;
	stat_inc(ST_IRQ);
	__u64 n = st->push_seq - st->flush_seq;
	if (n > MAX_PENDING)
		n = MAX_PENDING;
	struct flush_ctx c = { .tgid = tgid, .vq = vq, .seq = st->flush_seq, .now = bpf_ktime_get_ns() };
	st->flush_seq += n;
	bpf_loop(n, flush_one, &c, 0);
}

/* QEMU writes the guest notifier eventfd of a queue (event_notifier_set from
 * virtio_notify_irqfd): the guest interrupt, h.irq. */
SEC("tracepoint/syscalls/sys_enter_write")
int irq_write(struct trace_event_raw_sys_enter *ctx)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	if (!bpf_map_lookup_elem(&qemu_procs, &tgid))
		return 0;
	struct fd_key k = { .tgid = tgid, .fd = (__s32)ctx->args[0] };
	struct fd_val *v = bpf_map_lookup_elem(&notifier_fds, &k);
	if (!v || v->kind != FD_IRQ)
		return 0;
	flush_vq(tgid, v->vq);
	return 0;
}

/* QEMU reads a queue's host notifier eventfd (event_notifier_test_and_clear)
 * before it handles the guest's kick: h.notify. */
SEC("tracepoint/syscalls/sys_enter_read")
int kick_read(struct trace_event_raw_sys_enter *ctx)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	if (!bpf_map_lookup_elem(&qemu_procs, &tgid))
		return 0;
	struct fd_key k = { .tgid = tgid, .fd = (__s32)ctx->args[0] };
	struct fd_val *v = bpf_map_lookup_elem(&notifier_fds, &k);
	if (!v || v->kind != FD_KICK)
		return 0;
	struct tg_ptr vk = { .tgid = tgid, .ptr = v->vq };
	struct vq_state *st = bpf_map_lookup_elem(&vqs, &vk);
	if (st) {
		st->last_kick = bpf_ktime_get_ns();
		stat_inc(ST_KICKS);
	}
	return 0;
}

/* virtio_notify(vdev, vq): the non-dataplane path (early boot, ioeventfd=off)
 * raises the interrupt synchronously without an eventfd. */
SEC("uprobe")
int BPF_KPROBE(notify_direct, void *vdev, void *vq)
{
	__u32 tgid;
	struct qemu_layout *l = this_proc(&tgid);
	if (!l || !(l->flags & QL_HAVE_NOTIFIER))
		return 0;
	flush_vq(tgid, (__u64)vq);
	return 0;
}

/* ---- host I/O: syscalls of QEMU's threads ---- */

/* A host I/O of a traced QEMU starts on this thread; with assoc, the block
 * requests this thread issues until the syscall returns belong to it. */
/* Without blk_aio_* probes (QL_NO_SUBMIT) a host I/O is tracked from its
 * syscall, keyed by its first buffer; virtqueue_push finds it by the element's
 * first data buffer. A new I/O on a buffer starts its state afresh. */
static __always_inline __u64 *io_lazy(__u32 tgid, struct tg_ptr *bk)
{
	__u64 id = __sync_fetch_and_add(&next_merge_id, 1) + 1;
	struct io_state io = { .refs = 1, .buf = bk->ptr, .pad = 1 };
	struct tg_ptr ik = { .tgid = tgid, .ptr = id };
	if (bpf_map_update_elem(&ios, &ik, &io, BPF_ANY)) {
		stat_inc(ST_IOS_FULL);
		return NULL;
	}
	bpf_map_update_elem(&io_by_buf, bk, &id, BPF_ANY);
	return bpf_map_lookup_elem(&io_by_buf, bk);
}

static __always_inline int io_enter_assoc(__u64 buf, int assoc)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct qemu_layout *l = bpf_map_lookup_elem(&qemu_procs, &tgid);
	if (!l)
		return 0;
	struct tg_ptr bk = { .tgid = tgid, .ptr = buf };
	__u64 *mid = bpf_map_lookup_elem(&io_by_buf, &bk);
	if (!mid && (l->flags & QL_NO_SUBMIT))
		mid = io_lazy(tgid, &bk);
	if (!mid)
		return 0;
	struct tg_ptr ik = { .tgid = tgid, .ptr = *mid };
	struct io_state *io = bpf_map_lookup_elem(&ios, &ik);
	if (!io)
		return 0;
	if (io->pad && io->ts[HP_IO_ISSUE]) {
		/* lazily tracked and already issued: a new I/O on the same buffer */
		io->ts[HP_DISK_ISSUE] = 0;
		io->ts[HP_DISK_COMPLETE] = 0;
		io->ts[HP_IO_COMPLETE] = 0;
		io->ts[HP_IO_ISSUE] = 0;
	}
	if (!io->ts[HP_IO_ISSUE])
		io->ts[HP_IO_ISSUE] = bpf_ktime_get_ns();
	stat_inc(ST_IO_MATCHED);
	if (!assoc)
		return 0;
	struct tid_io t = { .tgid = tgid, .merge_id = *mid };
	bpf_map_update_elem(&tid_ios, &tid, &t, BPF_ANY);
	return 0;
}

static __always_inline int io_enter(__u64 buf)
{
	return io_enter_assoc(buf, 1);
}

static __always_inline int io_exit(int complete)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)id;
	struct tid_io *t = bpf_map_lookup_elem(&tid_ios, &tid);
	if (!t)
		return 0;
	if (complete) {
		struct tg_ptr ik = { .tgid = t->tgid, .ptr = t->merge_id };
		struct io_state *io = bpf_map_lookup_elem(&ios, &ik);
		if (io && !io->ts[HP_IO_COMPLETE])
			io->ts[HP_IO_COMPLETE] = bpf_ktime_get_ns();
	}
	bpf_map_delete_elem(&tid_ios, &tid);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_pread64")
int pread_enter(struct trace_event_raw_sys_enter *ctx)
{
	return io_enter(ctx->args[1]);
}

SEC("tracepoint/syscalls/sys_enter_pwrite64")
int pwrite_enter(struct trace_event_raw_sys_enter *ctx)
{
	return io_enter(ctx->args[1]);
}

static __always_inline int iov_enter(struct trace_event_raw_sys_enter *ctx)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	if (!bpf_map_lookup_elem(&qemu_procs, &tgid))
		return 0;
	return io_enter(read_u64(ctx->args[1])); /* iov[0].iov_base */
}

SEC("tracepoint/syscalls/sys_enter_preadv")
int preadv_enter(struct trace_event_raw_sys_enter *ctx)
{
	return iov_enter(ctx);
}

SEC("tracepoint/syscalls/sys_enter_pwritev")
int pwritev_enter(struct trace_event_raw_sys_enter *ctx)
{
	return iov_enter(ctx);
}

SEC("tracepoint/syscalls/sys_enter_preadv2")
int preadv2_enter(struct trace_event_raw_sys_enter *ctx)
{
	return iov_enter(ctx);
}

SEC("tracepoint/syscalls/sys_enter_pwritev2")
int pwritev2_enter(struct trace_event_raw_sys_enter *ctx)
{
	return iov_enter(ctx);
}

SEC("tracepoint/syscalls/sys_enter_fdatasync")
int fdatasync_enter(struct trace_event_raw_sys_enter *ctx)
{
	return io_enter(0);
}

SEC("tracepoint/syscalls/sys_enter_fsync")
int fsync_enter(struct trace_event_raw_sys_enter *ctx)
{
	return io_enter(0);
}

SEC("tracepoint/syscalls/sys_exit_pread64")
int pread_exit(void *ctx)
{
	return io_exit(1);
}

SEC("tracepoint/syscalls/sys_exit_pwrite64")
int pwrite_exit(void *ctx)
{
	return io_exit(1);
}

SEC("tracepoint/syscalls/sys_exit_preadv")
int preadv_exit(void *ctx)
{
	return io_exit(1);
}

SEC("tracepoint/syscalls/sys_exit_pwritev")
int pwritev_exit(void *ctx)
{
	return io_exit(1);
}

SEC("tracepoint/syscalls/sys_exit_preadv2")
int preadv2_exit(void *ctx)
{
	return io_exit(1);
}

SEC("tracepoint/syscalls/sys_exit_pwritev2")
int pwritev2_exit(void *ctx)
{
	return io_exit(1);
}

SEC("tracepoint/syscalls/sys_exit_fdatasync")
int fdatasync_exit(void *ctx)
{
	return io_exit(1);
}

SEC("tracepoint/syscalls/sys_exit_fsync")
int fsync_exit(void *ctx)
{
	return io_exit(1);
}

/* aio=native: io_submit(ctx, nr, iocbpp); completions are reaped from the
 * user-mapped ring without a syscall, so h.io_complete is not seen. */
struct iocbs_ctx {
	__u64 iocbpp;
	__u32 nr;
	__u32 assoc;
};

static long iocb_one(__u64 i, void *data)
{
	struct iocbs_ctx *c = data;
	if (i >= c->nr)
		return 1;
	__u64 iocb = read_u64(c->iocbpp + i * 8);
	if (!iocb)
		return 0;
	__u16 opcode = 0;
	bpf_probe_read_user(&opcode, sizeof(opcode), (void *)(iocb + 16)); /* aio_lio_opcode */
	__u64 buf = read_u64(iocb + 24);                                   /* aio_buf */
	if (opcode == 7 || opcode == 8) /* IOCB_CMD_PREADV/PWRITEV: buf is the iovec array */
		buf = read_u64(buf);
	else if (opcode == 2 || opcode == 3) /* FSYNC/FDSYNC */
		buf = 0;
	io_enter_assoc(buf, c->assoc);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_io_submit")
int io_submit_enter(struct trace_event_raw_sys_enter *ctx)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	if (!bpf_map_lookup_elem(&qemu_procs, &tgid))
		return 0;
	__s64 nr = ctx->args[1];
	if (nr <= 0)
		return 0;
	/* The block requests of a batch cannot be told apart: only a single iocb's
	 * are attributed (h.disk_*); every iocb gets its h.io_issue. */
	struct iocbs_ctx c = {
		.iocbpp = ctx->args[2],
		.nr = nr > MAX_IOCBS ? MAX_IOCBS : (__u32)nr,
		.assoc = nr == 1,
	};
	bpf_loop(MAX_IOCBS, iocb_one, &c, 0);
	return 0;
}

SEC("tracepoint/syscalls/sys_exit_io_submit")
int io_submit_exit(void *ctx)
{
	return io_exit(0);
}

/* aio=io_uring: user_data is QEMU's LuringAIOCB, which holds a copy of the SQE. */
SEC("tracepoint/io_uring/io_uring_submit_req")
int uring_submit(struct trace_event_raw_io_uring_submit_req *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct qemu_layout *l = bpf_map_lookup_elem(&qemu_procs, &tgid);
	if (!l || !(l->flags & QL_HAVE_LURING))
		return 0;
	__u64 ud = ctx->user_data;
	__u8 opcode = ctx->opcode;
	__u64 buf;
	if (opcode == 1 || opcode == 2) /* IORING_OP_READV/WRITEV: sqe.addr = iovec array */
		buf = read_u64(read_u64(ud + l->luring_sqe + 16));
	else if (opcode == 3) /* IORING_OP_FSYNC */
		buf = 0;
	else
		return 0;
	io_enter(buf);
	struct tid_io *t = bpf_map_lookup_elem(&tid_ios, &tid);
	if (t)
		bpf_map_update_elem(&uring_ios, &ud, t, BPF_ANY);
	return 0;
}

SEC("tracepoint/syscalls/sys_exit_io_uring_enter")
int uring_enter_exit(void *ctx)
{
	return io_exit(0);
}

SEC("tracepoint/io_uring/io_uring_complete")
int uring_complete(struct trace_event_raw_io_uring_complete *ctx)
{
	__u64 ud = ctx->user_data;
	struct tid_io *t = bpf_map_lookup_elem(&uring_ios, &ud);
	if (!t)
		return 0;
	struct tg_ptr ik = { .tgid = t->tgid, .ptr = t->merge_id };
	struct io_state *io = bpf_map_lookup_elem(&ios, &ik);
	if (io && !io->ts[HP_IO_COMPLETE])
		io->ts[HP_IO_COMPLETE] = bpf_ktime_get_ns();
	bpf_map_delete_elem(&uring_ios, &ud);
	return 0;
}

/* ---- host block layer ---- */

SEC("tp_btf/block_rq_issue")
int BPF_PROG(disk_issue, struct request *rq)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct tid_io *t = bpf_map_lookup_elem(&tid_ios, &tid);
	if (!t)
		return 0;
	struct tg_ptr ik = { .tgid = t->tgid, .ptr = t->merge_id };
	struct io_state *io = bpf_map_lookup_elem(&ios, &ik);
	if (!io)
		return 0;
	if (!io->ts[HP_DISK_ISSUE])
		io->ts[HP_DISK_ISSUE] = bpf_ktime_get_ns();
	__u64 k = (__u64)rq;
	bpf_map_update_elem(&rq_ios, &k, t, BPF_ANY);
	stat_inc(ST_DISK_MATCHED);
	return 0;
}

SEC("tp_btf/block_rq_complete")
int BPF_PROG(disk_complete, struct request *rq, blk_status_t error, unsigned int nr_bytes)
{
	__u64 k = (__u64)rq;
	struct tid_io *t = bpf_map_lookup_elem(&rq_ios, &k);
	if (!t)
		return 0;
	struct tg_ptr ik = { .tgid = t->tgid, .ptr = t->merge_id };
	struct io_state *io = bpf_map_lookup_elem(&ios, &ik);
	if (io)
		io->ts[HP_DISK_COMPLETE] = bpf_ktime_get_ns(); /* the last one */
	bpf_map_delete_elem(&rq_ios, &k);
	return 0;
}

/* ---- process exit: stop tracing it; userspace sweeps the maps ---- */

SEC("tracepoint/sched/sched_process_exit")
int proc_exit(void *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	bpf_map_delete_elem(&pop_arg, &tid);
	bpf_map_delete_elem(&tid_ios, &tid);
	if (tgid != tid)
		return 0;
	if (bpf_map_delete_elem(&qemu_procs, &tgid) == 0)
		stat_inc(ST_PROC_EXIT);
	return 0;
}

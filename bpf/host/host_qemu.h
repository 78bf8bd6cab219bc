/* SPDX-License-Identifier: GPL-2.0 */
/* QEMU uprobes: pop, elements from VirtIOBlockReq, backend submit, push and the flush of a queue's pushed elements (included by viotrace_host.bpf.c, in this order). */
#pragma once

/* ---- QEMU uprobes ---- */

/* --pop only: registers the queue before its first element is popped. */
SEC("uprobe")
int BPF_KPROBE(handle_vq, void *s, void *vq)
{
	stat_inc(ST_UPROBE_HITS);
	__u32 tgid;
	struct qemu_layout *l = this_proc(&tgid);
	if (!l)
		return 0;
	struct vq_state *st = vq_get(l, tgid, (__u64)vq, (__u64)s);
	if (st && !(l->flags & QL_HAVE_NOTIFIER))
		vq_kick(st, bpf_ktime_get_ns());
	return 0;
}

SEC("uprobe")
int BPF_KPROBE(pop_enter, void *vq)
{
	stat_inc(ST_UPROBE_HITS);
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
static __always_inline void rec_init(struct host_rec *r, __u32 tgid, __u32 head, __u64 vq,
				     struct vq_state *st)
{
	__builtin_memset(r, 0, sizeof(*r));
	r->ts[HP_NOTIFY] = st->last_kick;
	r->tgid = tgid;
	r->vq = vq;
	r->dev = st->dev;
	r->queue = st->queue;
	r->head = (__u16)head;
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
	rec_init(r, tgid, read_u32(e + l->elem_index), vq, st);
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
	stat_inc(ST_UPROBE_HITS);
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
	stat_inc(ST_UPROBE_HITS);
	__u32 tgid;
	struct qemu_layout *l = this_proc(&tgid);
	if (!l || !elem)
		return 0;
	return pop_done(l, tgid, (__u64)vq, (__u64)elem);
}

/*
 * Element state from a VirtIOBlockReq seen for the first time at submit or push
 * (default mode: no virtqueue_pop probe). The header comes from the request's
 * own copy (req->out). push_vq: the queue virtqueue_push was given (0: not at
 * push); there it is the element's queue, whatever VirtIOBlockReq.vq reads.
 * Built in scratch `slot`: SCRATCH_PUSH returns the scratch record itself (the
 * element being pushed), SCRATCH_BUILD stores it in `elems` and returns that.
 * v: the request read once (req_view_read), or NULL.
 * Returns NULL if not a tracked virtio-blk request (or `elems` is full).
 */
static __always_inline struct host_rec *elem_build(struct qemu_layout *l, __u32 tgid, __u64 req,
						   struct req_view *v, int create_vq, __u64 push_vq,
						   __u32 slot)
{
	struct tg_ptr ek = { .tgid = tgid, .ptr = req };
	struct host_rec *r;
	int at_push = push_vq != 0;
	__u64 vq = at_push ? push_vq : rv_u64(v, req, l->req_vq);
	struct vq_state *st;
	if (create_vq) {
		/* blk_aio_* serve every device model: a VirtIOBlockReq's queue belongs
		 * to the request's device (vq->vdev == req->dev). */
		__u64 dev = rv_u64(v, req, l->req_dev);
		/* Counted for the runtime check (refusal) at submit only: every virtio
		 * device pushes through virtqueue_push, other block devices rarely use
		 * blk_aio_*. At push they are counted apart, for a warning. */
		if (!vq || !dev || read_u64(vq + l->vq_vdev) != dev) {
			__sync_fetch_and_add(at_push ? &l->push_bad : &l->vdev_bad, 1);
			return NULL;
		}
		__sync_fetch_and_add(at_push ? &l->push_ok : &l->vdev_ok, 1);
		st = vq_get(l, tgid, vq, dev);
	} else {
		struct tg_ptr vk = { .tgid = tgid, .ptr = vq };
		st = bpf_map_lookup_elem(&vqs, &vk);
	}
	if (!st)
		return NULL;
	r = bpf_map_lookup_elem(&scratch, &slot);
	if (!r)
		return NULL;
	rec_init(r, tgid, rv_u32(v, req, l->elem_index), vq, st);
	struct {
		__u32 type;
		__u32 ioprio;
		__u64 sector;
	} hdr = {};
	if (v && l->req_out <= REQ_SPAN - sizeof(hdr)) {
		hdr.type = rv_u32(v, req, l->req_out);
		hdr.sector = rv_u64(v, req, l->req_out + 8);
	} else if (bpf_probe_read_user(&hdr, sizeof(hdr), (void *)(req + l->req_out))) {
		stat_inc(ST_HDR_FAULT);
		r->flags |= HR_HDR_FAULT;
	}
	r->type = hdr.type;
	r->sector = hdr.sector;
	if (at_push) {
		/* h.submit: QEMU's block accounting start, taken as virtio-blk parses
		 * the request, just before its batch goes to the backend (reads,
		 * writes, flushes only: other requests never set it, and the memory
		 * may hold an earlier request's; push_submit_check drops it if the
		 * request failed before it was set) */
		if (hdr.type == 0 || hdr.type == 1 || hdr.type == 4)
			r->ts[HP_SUBMIT] = rv_u64(v, req, l->req_acct_start);
		/* no blk_aio_* probe: the sizes from the element's scatter lists,
		 * restored by QEMU before the push */
		__u32 out_b = sg_bytes(rv_u64(v, req, l->elem_out_sg), rv_u32(v, req, l->elem_out_num));
		__u32 in_b = sg_bytes(rv_u64(v, req, l->elem_in_sg), rv_u32(v, req, l->elem_in_num));
		out_b = out_b > VIRTIO_BLK_OUTHDR ? out_b - VIRTIO_BLK_OUTHDR : 0;
		in_b = in_b > 1 ? in_b - 1 : 0;
		r->bytes = out_b + in_b;
		r->flags |= HR_HAVE_BYTES;
	}
	/* the element being pushed: the caller keeps the scratch record */
	if (slot == SCRATCH_PUSH)
		return r;
	if (bpf_map_update_elem(&elems, &ek, r, BPF_ANY)) {
		stat_inc(ST_ELEMS_FULL);
		return NULL;
	}
	return bpf_map_lookup_elem(&elems, &ek);
}

/* The tracked state of a request, or elem_build's, stored in `elems`. */
static __always_inline struct host_rec *elem_from_req(struct qemu_layout *l, __u32 tgid, __u64 req,
						      int create_vq, __u64 push_vq)
{
	struct tg_ptr ek = { .tgid = tgid, .ptr = req };
	struct host_rec *r = bpf_map_lookup_elem(&elems, &ek);

	return r ? r : elem_build(l, tgid, req, req_view_read(req), create_vq, push_vq, SCRATCH_BUILD);
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

/*
 * An argument of a uprobe placed past its function's entry, where the function
 * may have moved it to another register first (host-agent/src/qemu/
 * probe_site.rs): the attach cookie's 4 bits at position `i` name that
 * register (probe_site::MOVE_REGS: 1 ax … 7 bp, 8 r8 … 15 r15), 0 its own
 * (`own`, the argument as BPF_KPROBE reads it).
 */
static __always_inline __u64 site_arg(struct pt_regs *ctx, __u64 cookie, int i, __u64 own)
{
	__u64 code = (cookie >> (4 * i)) & 0xf;

	/* (not moved: every site on most builds) */
	if (!code)
		return own;
	/* (each register a load at a constant offset: the verifier refuses a
	 * context read at an offset computed from the cookie) */
	__u64 regs[16] = {
		own,	 ctx->ax,  ctx->bx,  ctx->cx,  ctx->dx,	 ctx->si,  ctx->di,  ctx->bp,
		ctx->r8, ctx->r9, ctx->r10, ctx->r11, ctx->r12, ctx->r13, ctx->r14, ctx->r15,
	};

	return regs[code];
}

SEC("uprobe")
int BPF_KPROBE(submit_rw, void *blk, __s64 offset, void *qiov, int flags, void *cb, void *opaque)
{
	stat_inc(ST_UPROBE_HITS);
	__u64 c = bpf_get_attach_cookie(ctx);
	__u64 q = site_arg(ctx, c, 2, (__u64)qiov);
	__u64 iov = read_u64(q); /* QEMUIOVector.iov */
	__u64 buf = iov ? read_u64(iov) : 0;
	__u32 tgid;
	struct qemu_layout *l = this_proc(&tgid);
	if (!l)
		return 0;
	__s64 size = (__s64)read_u64(q + l->qiov_size);
	return on_submit((void *)site_arg(ctx, c, 5, (__u64)opaque), buf, 1, size);
}

SEC("uprobe")
int BPF_KPROBE(submit_flush, void *blk, void *cb, void *opaque)
{
	stat_inc(ST_UPROBE_HITS);
	return on_submit((void *)site_arg(ctx, bpf_get_attach_cookie(ctx), 2, (__u64)opaque), 0, 1,
			 -1);
}

SEC("uprobe")
int BPF_KPROBE(submit_discard, void *blk, __s64 offset, __s64 bytes, void *cb, void *opaque)
{
	stat_inc(ST_UPROBE_HITS);
	__u64 c = bpf_get_attach_cookie(ctx);
	return on_submit((void *)site_arg(ctx, c, 4, (__u64)opaque), 0, 0,
			 (__s64)site_arg(ctx, c, 2, bytes));
}

SEC("uprobe")
int BPF_KPROBE(submit_wzeroes, void *blk, __s64 offset, __s64 bytes, int flags, void *cb, void *opaque)
{
	stat_inc(ST_UPROBE_HITS);
	__u64 c = bpf_get_attach_cookie(ctx);
	return on_submit((void *)site_arg(ctx, c, 5, (__u64)opaque), 0, 0,
			 (__s64)site_arg(ctx, c, 2, bytes));
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
	r->disk_dev = io->disk_dev;
	r->nb_inflight = io->nb_inflight;
	r->nb_issued = io->nb_issued;
	r->nb_bytes = io->nb_bytes;
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

/* h.submit from the request's accounting start: only for a request that did not
 * fail (an invalid one is completed before accounting starts) and that lies
 * before its push within 10 s. */
static __always_inline void push_submit_check(struct host_rec *r)
{
	__u64 t = r->ts[HP_SUBMIT], now = r->ts[HP_PUSH];
	if (!t)
		return;
	if ((r->has_status && r->status) || t > now || now - t > 10000000000ULL)
		r->ts[HP_SUBMIT] = 0;
}

struct push_chain_ctx {
	struct qemu_layout *l;
	__u32 tgid;
	__u32 n;
	__u64 req;
	__u64 id;
	__u64 vq;
};

static long push_chain_one(__u64 i, void *data)
{
	struct push_chain_ctx *c = data;
	struct qemu_layout *l = c->l;
	if (!l || !c->req)
		return 1;
	struct host_rec *m = elem_from_req(l, c->tgid, c->req, 1, c->vq);
	if (m) {
		m->merge_id = c->id;
		m->flags |= HR_MERGED;
		c->n++;
	}
	c->req = read_u64(c->req + l->req_mr_next);
	return c->req ? 0 : 1;
}

/* At the push of a merged chain's head (push-only mode): its other requests,
 * pushed right after it, are given its backend I/O (and its io state one
 * reference each). */
static __always_inline void push_take_chain(struct qemu_layout *l, __u32 tgid, __u64 head,
					    struct host_rec *r)
{
	struct push_chain_ctx c = {
		.l = l,
		.tgid = tgid,
		.req = read_u64(head + l->req_mr_next),
		.id = r->merge_id,
		.vq = r->vq,
	};
	r->flags |= HR_MERGED;
	bpf_loop(MAX_CHAIN, push_chain_one, &c, 0);
	if (c.req)
		stat_inc(ST_CHAIN_LONG);
	__u32 idx = ST_SUBMIT_MERGED;
	__u64 *v = bpf_map_lookup_elem(&stats, &idx);
	if (v)
		__sync_fetch_and_add(v, c.n + 1);
	if (!c.id)
		return;
	struct tg_ptr ik = { .tgid = tgid, .ptr = c.id };
	struct io_state *io = bpf_map_lookup_elem(&ios, &ik);
	if (io)
		io->refs += c.n;
}

SEC("uprobe")
int BPF_KPROBE(push, void *vq, void *elem, unsigned int len)
{
	stat_inc(ST_UPROBE_HITS);
	__u32 tgid;
	struct qemu_layout *l = this_proc(&tgid);
	if (!l)
		return 0;
	struct tg_ptr vk = { .tgid = tgid, .ptr = (__u64)vq };
	struct vq_state *st = bpf_map_lookup_elem(&vqs, &vk);
	int at_push = (l->flags & QL_NO_SUBMIT) ? 1 : 0;
	if (!st && !at_push) {
		stat_inc(ST_PUSH_OTHER); /* not a virtio-blk queue (yet) */
		return 0;
	}
	struct tg_ptr ek = { .tgid = tgid, .ptr = (__u64)elem };
	/* without blk_aio_* probes the element is usually first seen here (its
	 * queue too), built in scratch and never stored in `elems`; an element
	 * already there (submit probes, a merged chain's member) is deleted below */
	struct host_rec *r = bpf_map_lookup_elem(&elems, &ek);
	int stored = r != NULL;
	/* valid until push_take_chain, which reads the chain's other requests */
	struct req_view *v = req_view_read((__u64)elem);
	if (!r)
		r = elem_build(l, tgid, (__u64)elem, v, at_push, at_push ? (__u64)vq : 0, SCRATCH_PUSH);
	if (!r) {
		stat_inc(st ? ST_PUSH_UNKNOWN : ST_PUSH_OTHER);
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
		__u64 in = rv_u64(v, (__u64)elem, l->req_in);
		if (in && !bpf_probe_read_user(&r->status, 1, (void *)in))
			r->has_status = 1;
	}
	if (at_push) {
		push_submit_check(r);
		/* taken at push, the element's h.notify is the kick before its
		 * h.submit, not the queue's latest (a later batch's) */
		r->ts[HP_NOTIFY] = vq_notify_of(st, r->ts[HP_SUBMIT]);
		st->pushes[st->push_n++ & (PUSH_RING - 1)] = r->ts[HP_PUSH];
	}
	if (at_push && !r->merge_id) {
		/* fallback: the host I/O whose first buffer is the element's first data
		 * buffer (reads: in_sg[0]; writes: after the 16-byte header in out_sg) */
		__u64 buf = 0;
		if (r->type == 0) {
			buf = read_u64(rv_u64(v, (__u64)elem, l->elem_in_sg));
		} else if (r->type == 1) {
			__u64 sg = rv_u64(v, (__u64)elem, l->elem_out_sg);
			__u64 len0 = read_u64(sg + 8);
			buf = len0 > VIRTIO_BLK_OUTHDR ? read_u64(sg) + VIRTIO_BLK_OUTHDR
						       : read_u64(sg + 16);
		}
		struct tg_ptr bk = { .tgid = tgid, .ptr = buf };
		__u64 *mid = bpf_map_lookup_elem(&io_by_buf, &bk);
		if (mid && (buf || r->type == 4))
			r->merge_id = *mid;
		/* a merged backend request completes head first: its other
		 * requests share its host I/O */
		if ((l->flags & QL_HAVE_MR_NEXT) && rv_u64(v, (__u64)elem, l->req_mr_next))
			push_take_chain(l, tgid, (__u64)elem, r);
	}
	if (r->merge_id)
		io_release(tgid, r->merge_id, r);

	/* The element waits in `pushed` for its queue's next guest notification
	 * (h.irq), unless nothing would give one: no notifier fds, or a queue not yet
	 * seen notifying through its eventfd (QL_IRQ_LEARN); then, or when `pushed`
	 * is full, it is emitted now. */
	int wait_irq = 0;
	if (l->flags & QL_HAVE_NOTIFIER) {
		/* notifier fds change when the guest resets the device: follow them */
		__s32 kfd = read_fd((__u64)vq + l->vq_host_notifier_rfd);
		if (kfd != st->kick_fd) {
			st->kick_fd = kfd;
			fd_register(tgid, kfd, (__u64)vq, FD_KICK);
			fd_register(tgid, read_fd((__u64)vq + l->vq_guest_notifier_wfd), (__u64)vq,
				    FD_IRQ);
		}
		wait_irq = !(l->flags & QL_IRQ_LEARN) || st->irq_by_fd;
		if (!wait_irq)
			stat_inc(ST_IRQ_UNTRACED);
	}
	struct pushed_key pk = { .tgid = tgid, .vq = (__u64)vq, .seq = st->push_seq };
	if (wait_irq && bpf_map_update_elem(&pushed, &pk, r, BPF_ANY)) {
		stat_inc(ST_PUSHED_FULL);
		wait_irq = 0;
	}
	if (!wait_irq)
		emit(r);
	/* (r may be this entry: emitted or copied into `pushed` first) */
	if (stored)
		bpf_map_delete_elem(&elems, &ek);
	if (!wait_irq)
		return 0;
	st->push_seq++;
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

/* The state of queue `vq` of process `tgid`, if it is a traced queue. */
static __always_inline struct vq_state *traced_vq(__u32 tgid, __u64 vq)
{
	struct tg_ptr vk = { .tgid = tgid, .ptr = vq };
	return bpf_map_lookup_elem(&vqs, &vk);
}

/* A guest notification on traced queue `vq` (state `st`): its pushed elements get h.irq. */
static __always_inline void flush_st(__u32 tgid, __u64 vq, struct vq_state *st)
{
	stat_inc(ST_IRQ);
	__u64 n = st->push_seq - st->flush_seq;
	if (n > MAX_PENDING)
		n = MAX_PENDING;
	struct flush_ctx c = { .tgid = tgid, .vq = vq, .seq = st->flush_seq, .now = bpf_ktime_get_ns() };
	st->flush_seq += n;
	bpf_loop(n, flush_one, &c, 0);
}

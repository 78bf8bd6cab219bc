/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Kernel differences between 5.10 and 7.x, resolved when the object is loaded
 * (CO-RE relocations against the running kernel's BTF). Every check here is a
 * load-time constant: the verifier drops the branch this kernel does not take,
 * and with it the relocations that could not be resolved. Nothing here costs
 * anything per I/O.
 *
 *   bio disk          5.10: bio->bi_disk          5.12+: bio->bi_bdev->bd_disk
 *   request disk      5.10: rq->rq_disk           5.16+: rq->q->disk
 *   page cache page   5.10: page->mapping/index   5.16+: folio (7.x: page->__folio_index)
 *   bio tracepoints   5.10: (q, bio), merges (q, rq, bio)   5.11+: (bio), (bio)
 *   io_uring submit   5.10 (Debian backport), 5.15: io_uring_submit_sqe(ctx, req, ...),
 *                     request's file already resolved (req->file), io_rw in a union
 *                     5.19-6.1: io_uring_submit_sqe(req, force_nonblock), req->cqe.fd
 *                     6.2+:     io_uring_submit_req(req), req->cqe.fd
 *   vring_virtqueue   in virtio_ring's module BTF (5.11+) or vmlinux (6.12+);
 *                     without it, userspace may allow the 5.0-6.x layout (free_head
 *                     right after the 6-8 bools that follow the embedded virtqueue).
 */
#ifndef VIOTRACE_GUEST_CORE_FIXES_H
#define VIOTRACE_GUEST_CORE_FIXES_H

#include "vt_core_fixes.h"

/*
 * Several fields of one kernel object in one probe read. Under emulation a
 * probe read costs about as much as a map lookup (≈160 ns in the lab's TCG
 * guest), so fields that lie close together are read as one window: the bytes
 * from the lowest field to the end of the highest, taken from the buffer at
 * their CO-RE offsets. The offsets are load-time constants, so the verifier
 * sees constant stack offsets and drops the per-field fallback (taken on a
 * kernel where the fields lie further apart than the window).
 */
#define WIN_MAX 128
#define WIN_MIN(a, b) ((a) < (b) ? (a) : (b))
#define WIN_MAXOF(a, b) ((a) > (b) ? (a) : (b))
/* the window [lo, hi) of the object at p fits in w */
#define WIN_FITS(w, lo, hi) ((hi) - (lo) <= sizeof(w))
#define WIN_READ(w, p, lo, hi) bpf_probe_read_kernel(w, (hi) - (lo), (void *)(p) + (lo))
/* the field at offset off (of the object) from the window that starts at lo */
#define WIN_GET(w, type, off, lo) (*(type *)((void *)(w) + ((off) - (lo))))

/* ---- disks ---- */

struct bio___old {
	struct gendisk *bi_disk;
} __attribute__((preserve_access_index));

/* What bio_queue needs of a bio, from one window read where the fields lie close. */
struct bio_head {
	void *devp;		/* bi_bdev (5.12+) or bi_disk */
	struct bio_vec *vec;	/* bi_io_vec */
	__u32 size;		/* bi_iter.bi_size */
	bool bdev;		/* devp is a block_device */
};

/* bio_head_read() with the offset of the bio's device field (bi_bdev or bi_disk). */
static __always_inline bool bio_head_at(struct bio *bio, struct bio_head *h, __u32 o_dev, bool bdev)
{
	__u32 o_size = bpf_core_field_offset(bio->bi_iter) +
		       bpf_core_field_offset(struct bvec_iter, bi_size);
	__u32 o_vec = bpf_core_field_offset(bio->bi_io_vec);
	__u32 lo = WIN_MIN(o_dev, WIN_MIN(o_size, o_vec));
	__u32 hi = WIN_MAXOF(o_dev + 8, WIN_MAXOF(o_size + 4, o_vec + 8));
	__u8 w[WIN_MAX];
	void *dev = NULL;

	h->bdev = bdev;
	if (WIN_FITS(w, lo, hi)) {
		if (WIN_READ(w, bio, lo, hi))
			return false;
		dev = WIN_GET(w, void *, o_dev, lo);
		h->size = WIN_GET(w, __u32, o_size, lo);
		h->vec = WIN_GET(w, struct bio_vec *, o_vec, lo);
	} else {
		bpf_probe_read_kernel(&dev, sizeof(dev), (void *)bio + o_dev);
		h->size = BPF_CORE_READ(bio, bi_iter.bi_size);
		h->vec = BPF_CORE_READ(bio, bi_io_vec);
	}
	h->devp = dev;
	return dev != NULL;
}

static __always_inline bool bio_head_read(struct bio *bio, struct bio_head *h)
{
	struct bio___old *o = (void *)bio;

	if (bpf_core_field_exists(bio->bi_bdev))
		return bio_head_at(bio, h, bpf_core_field_offset(bio->bi_bdev), true);
	if (bpf_core_field_exists(o->bi_disk))
		return bio_head_at(bio, h, bpf_core_field_offset(o->bi_disk), false);
	return false;
}

/* rq_disk(): vt_core_fixes.h (shared with the host object) */

/* What the request hooks need of a request: one window read (q … biotail are
 * within its first 80 bytes on every kernel). */
struct rq_head {
	void *q;
	struct bio *bio;
	struct bio *biotail;	/* the chain's last bio: no read of its bi_next */
	__u64 sector;
	__u32 bytes;
	__u32 cmd_flags;
};

static __always_inline bool rq_head_read(struct request *rq, struct rq_head *h)
{
	__u32 o_q = bpf_core_field_offset(struct request, q);
	__u32 o_bio = bpf_core_field_offset(struct request, bio);
	__u32 o_tail = bpf_core_field_offset(struct request, biotail);
	__u32 o_sec = bpf_core_field_offset(struct request, __sector);
	__u32 o_len = bpf_core_field_offset(struct request, __data_len);
	__u32 o_fl = bpf_core_field_offset(struct request, cmd_flags);
	__u32 lo = WIN_MIN(WIN_MIN(o_q, WIN_MIN(o_bio, o_tail)),
			   WIN_MIN(o_sec, WIN_MIN(o_len, o_fl)));
	__u32 hi = WIN_MAXOF(WIN_MAXOF(o_q + 8, WIN_MAXOF(o_bio + 8, o_tail + 8)),
			     WIN_MAXOF(o_sec + 8, WIN_MAXOF(o_len + 4, o_fl + 4)));
	__u8 w[WIN_MAX];

	if (WIN_FITS(w, lo, hi)) {
		if (WIN_READ(w, rq, lo, hi))
			return false;
		h->q = WIN_GET(w, void *, o_q, lo);
		h->bio = WIN_GET(w, struct bio *, o_bio, lo);
		h->biotail = WIN_GET(w, struct bio *, o_tail, lo);
		h->sector = WIN_GET(w, __u64, o_sec, lo);
		h->bytes = WIN_GET(w, __u32, o_len, lo);
		h->cmd_flags = WIN_GET(w, __u32, o_fl, lo);
		return true;
	}
	h->q = BPF_CORE_READ(rq, q);
	h->bio = BPF_CORE_READ(rq, bio);
	h->biotail = BPF_CORE_READ(rq, biotail);
	h->sector = BPF_CORE_READ(rq, __sector);
	h->bytes = BPF_CORE_READ(rq, __data_len);
	h->cmd_flags = BPF_CORE_READ(rq, cmd_flags);
	return true;
}

/* The request's disk, its queue already read (5.16+: q->disk; before: rq->rq_disk). */
static __always_inline struct gendisk *rq_disk_of(struct request *rq, void *q)
{
	if (bpf_core_field_exists(struct request_queue___new, disk))
		return BPF_CORE_READ((struct request_queue___new *)q, disk);
	return rq_disk(rq);
}

/* ---- page cache: mapping and index of a bio's page ---- */

struct page___old {
	struct address_space *mapping;
	unsigned long index;
} __attribute__((preserve_access_index));

/* The folio (or, before folios, the page) that `page` belongs to as far as
 * mapping and index go: a folio starts with its head page. */
static __always_inline struct address_space *page_mapping_of(struct page *page)
{
	if (bpf_core_type_exists(struct folio))
		return BPF_CORE_READ((struct folio *)page, mapping);
	return BPF_CORE_READ((struct page___old *)page, mapping);
}

static __always_inline __u64 page_index_of(struct page *page)
{
	if (bpf_core_type_exists(struct folio))
		return BPF_CORE_READ((struct folio *)page, index);
	return BPF_CORE_READ((struct page___old *)page, index);
}

/* ---- tracepoint argument lists ---- */

/*
 * Prototypes that changed, read by userspace from this kernel's BTF
 * (btf_trace_<name>): clang 14 cannot emit type-match relocations. Read-only
 * data is a load-time constant: the verifier drops the branch not taken, so a
 * program never reads past the arguments this kernel's tracepoint has.
 */
/* 5.10: block_bio_queue(q, bio), block_split(q, bio, sector),
 * block_bio_{back,front}merge(q, rq, bio); 5.11+: the bio first. */
const volatile __u8 tp_bio_has_queue = 0;
/* Position of the request in io_uring_submit_sqe: 1 = (ctx, req, ...) (5.10
 * Debian backport, 5.15), 0 = (req, force_nonblock) (5.19-6.1). */
const volatile __u8 tp_uring_sqe_req_pos = 0;

/*
 * ctx[n] as a load the compiler cannot merge with another one: clang turns
 * `c ? ctx[1] : ctx[0]` into ctx + variable offset, which the verifier refuses
 * for context pointers. With both loads fixed, the branch on a read-only
 * constant stays a branch and the verifier drops the dead load.
 */
#define CTX_ARG(ctx, n)                                                          \
	({                                                                       \
		__u64 __v;                                                       \
		asm volatile("%0 = *(u64 *)(%1 + %2)" : "=r"(__v) : "r"(ctx), "i"((n) * 8)); \
		(void *)__v;                                                     \
	})
#define TP_ARG(ctx, old, old_pos) ((old) ? CTX_ARG(ctx, old_pos) : CTX_ARG(ctx, 0))
#define TP_BIO_QUEUE_BIO(ctx) ((struct bio *)TP_ARG(ctx, tp_bio_has_queue, 1))
#define TP_SPLIT_BIO(ctx) ((struct bio *)TP_ARG(ctx, tp_bio_has_queue, 1))
#define TP_MERGE_BIO(ctx) ((struct bio *)TP_ARG(ctx, tp_bio_has_queue, 2))

/* ---- io_uring ---- */

struct io_cqe___new {
	int fd;
} __attribute__((preserve_access_index));

struct io_kiocb___new {
	struct io_cmd_data cmd;
	struct io_cqe___new cqe;
} __attribute__((preserve_access_index));

struct io_rw___old {
	struct kiocb kiocb;
} __attribute__((preserve_access_index));

struct io_kiocb___old {
	struct file *file;
	struct io_rw___old rw;
} __attribute__((preserve_access_index));

/* Where the per-opcode command data (struct io_rw for reads and writes) sits. */
static __always_inline void *uring_cmd(struct io_kiocb *req)
{
	struct io_kiocb___new *n = (void *)req;
	struct io_kiocb___old *o = (void *)req;

	if (bpf_core_field_exists(n->cmd))
		return (void *)req + bpf_core_field_offset(n->cmd);
	if (bpf_core_field_exists(o->rw))
		return (void *)req + bpf_core_field_offset(o->rw);
	return NULL;
}

/* ---- virtio_ring ---- */

/* Userspace: the 5.0-6.x vring_virtqueue layout may be assumed (no BTF for it). */
const volatile __u8 vvq_assume_layout = 0;

/* The descriptor head the next buffer added to vq takes (its free_head). */
static __always_inline bool vq_free_head(struct virtqueue *vq, __u16 *head)
{
	__u32 h = 0;

	if (bpf_core_type_exists(struct vring_virtqueue)) {
		struct vring_virtqueue *vvq;

		vvq = (void *)vq - bpf_core_field_offset(struct vring_virtqueue, vq);
		*head = BPF_CORE_READ(vvq, free_head);
		return true;
	}
	if (!vvq_assume_layout)
		return false;
	/* struct virtqueue vq; 6 (5.x) or 8 (6.5+) bools; unsigned int free_head */
	if (bpf_probe_read_kernel(&h, sizeof(h), (void *)vq + bpf_core_type_size(struct virtqueue) + 8))
		return false;
	*head = h;
	return true;
}

/* Tasks (state, CPU): vt_core_fixes.h. */

#endif

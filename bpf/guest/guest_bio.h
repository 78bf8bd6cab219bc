/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Block layer, bios: queued, split, merged into a request. Raw tracepoints
 * (pointer arguments, CO-RE reads) work in every mode.
 *
 * Attribution happens once, when a bio is queued: a bio queued inside a traced
 * syscall belongs to that syscall's task and file; a page-cache bio queued by a
 * kernel worker (write-back, read-ahead) belongs to the file its first page
 * maps, to the cgroup that owns the bio, and to the task that last dirtied
 * that file when known. The requests (guest_block.h) take it from their bios.
 */
#ifndef VIOTRACE_GUEST_BIO_H
#define VIOTRACE_GUEST_BIO_H

#define VT_PAGE_SHIFT 12
#define VT_PF_KTHREAD 0x00200000

enum page_kind {
	PG_OTHER = 0,	/* anonymous / user buffer (direct I/O) / no page */
	PG_FILE = 1,	/* page cache of a regular file */
	PG_BDEV = 2,	/* page cache of the block device: file system metadata */
};

/* What a bio's first page is; for page-cache pages, its inode and byte offset. */
static __always_inline int bio_page_file(struct bio_vec *vec, __u64 *ino, __u64 *off)
{
	struct bio_vec bv = {};
	struct address_space *mapping;
	struct inode *host;

	/* struct bio_vec { page, len, offset }: one read */
	if (!vec || bpf_probe_read_kernel(&bv, sizeof(bv), vec) || !bv.bv_page)
		return PG_OTHER;
	mapping = page_mapping_of(bv.bv_page);
	/* low bits set: anonymous / movable / KSM, not a file mapping */
	if (!mapping || ((unsigned long)mapping & 3))
		return PG_OTHER;
	host = BPF_CORE_READ(mapping, host);
	if (!host)
		return PG_OTHER;
	*off = (page_index_of(bv.bv_page) << VT_PAGE_SHIFT) + bv.bv_offset;
	switch (inode_kind(host, ino)) {
	case VT_S_IFREG:
		return PG_FILE;
	case VT_S_IFBLK:
		return PG_BDEV;
	}
	return PG_OTHER;
}

/* The slot of `bio` among the syscall's queued bios, or -1. */
static __always_inline int qbio_find(struct sys_state *s, __u64 bio)
{
	if (!s || !bio)
		return -1;
	/* only the slots this syscall filled: the others hold older syscalls' bios */
	for (int i = 0; i < QBIOS; i++) {
		if (i >= s->qbio_next)
			break;
		if (s->qbios[i].bio == bio)
			return i;
	}
	return -1;
}

/* Moves a queued bio of the syscall into the `bios` map: it merged into a
 * request that may be issued elsewhere, or its slot is needed. */
static __always_inline void qbio_spill(struct sys_state *s, __u32 tid, int i)
{
	struct bio_state b = {};
	struct qbio *q;
	__u64 key;

	if (i < 0 || i >= QBIOS)
		return;
	q = &s->qbios[i];
	key = q->bio;
	b.id = s->id;
	b.queue_ts = q->queue_ts;
	b.inode = q->inode;
	b.offset = q->offset;
	b.has_offset = q->has_offset;
	b.dev = q->dev;
	b.owner_tid = tid;
	b.owner_enter_ts = s->enter_ts;
	q->bio = 0;
	if (bpf_map_update_elem(&bios, &key, &b, BPF_ANY))
		stat_inc(S_FULL_BIO);
}

static __always_inline void qbio_put(struct sys_state *s, __u32 tid, __u64 bio,
				     const struct bio_state *b)
{
	__u32 n = s->qbio_next;
	__u32 i = n & (QBIOS - 1);
	struct qbio *q = &s->qbios[i];

	/* a slot this syscall filled before (the ring wrapped) and still waiting */
	if (n >= QBIOS && q->bio)
		qbio_spill(s, tid, i);
	q->bio = bio;
	q->queue_ts = b->queue_ts;
	q->inode = b->inode;
	q->offset = b->offset;
	q->has_offset = b->has_offset;
	q->dev = b->dev;
	s->qbio_next = n + 1;
}

/*
 * The disk of a bio about to be tracked: its dev, and whether to track it at
 * all (a blk-mq disk that passes the disk filter). From this CPU's disk cache,
 * or three probe reads that refill it.
 */
static __always_inline bool bio_disk_info(const struct bio_head *bh, __u64 now, __u32 *dev)
{
	/* locals: a CO-RE read of bh->devp would relocate bio_head's field too */
	void *devp = bh->devp;
	bool bdev = bh->bdev;
	__u64 key = (__u64)devp;
	__u32 i = ptr_slot(key, DISK_SLOTS);
	struct disk_slot *d = bpf_map_lookup_elem(&disks, &i);
	struct gendisk *disk;
	__u32 dv, ok;

	if (!d)
		return false;
	if (d->key == key && now - d->filled_ts < DISK_TTL_NS) {
		*dev = d->dev;
		return d->mq;
	}
	disk = bdev ? BPF_CORE_READ((struct block_device *)devp, bd_disk) : devp;
	if (!disk)
		return false;
	dv = disk_dev(disk);
	/* only blk-mq disks produce requests */
	ok = BPF_CORE_READ(disk, queue, mq_ops) != NULL && dev_ok(dv);
	d->key = key;
	d->dev = dv;
	d->mq = ok;
	d->filled_ts = now;
	*dev = dv;
	return ok;
}

/*
 * bio_head and the disk's dev from a typed bio (tp_btf): plain loads, with no
 * probe read and no disk cache. False when the disk is not blk-mq or fails the
 * disk filter.
 */
static __always_inline bool bio_typed(struct bio *bio, struct bio_head *h, __u32 *dev)
{
	struct bio___old *o = (void *)bio;
	struct gendisk *disk;

	if (bpf_core_field_exists(bio->bi_bdev)) {
		struct block_device *bd = bio->bi_bdev;

		disk = bd ? bd->bd_disk : NULL;
		h->bdev = true;
	} else if (bpf_core_field_exists(o->bi_disk)) {
		disk = o->bi_disk;
		h->bdev = false;
	} else {
		return false;
	}
	if (!disk)
		return false;
	h->size = bio->bi_iter.bi_size;
	h->vec = bio->bi_io_vec;
	*dev = ((__u32)disk->major << 20) | (__u32)disk->first_minor;
	/* only blk-mq disks produce requests */
	return disk->queue && disk->queue->mq_ops && dev_ok(*dev);
}

/*
 * A bio queued: its state (see the top of this file). `typed`: the bio is a
 * BTF pointer (tp_btf program), read with plain loads.
 */
static __always_inline void bio_queued(struct bio *bio, bool typed)
{
	__u64 pt = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)pt;
	struct bio_head bh = {};
	struct sys_state *s;
	struct bio_state b = {};
	__u64 key = (__u64)bio;
	__u64 pino = 0, poff = 0;
	int kind;

	if ((pt >> 32) == self_pid)
		return;
	b.queue_ts = bpf_ktime_get_ns();
	if (typed ? !bio_typed(bio, &bh, &b.dev)
		  : !bio_head_read(bio, &bh) || !bio_disk_info(&bh, b.queue_ts, &b.dev))
		return;
	s = sys_get(&tid);
	/* direct I/O inside a traced syscall takes the syscall's file: no page walk */
	kind = (s && s->cur.direct) ? PG_OTHER : bio_page_file(bh.vec, &pino, &poff);
	/* buffered I/O on the block device node itself: its pages are the file */
	if (kind == PG_BDEV && s && s->cur.inode == pino)
		kind = PG_FILE;
	if (s) {
		b.id = s->id;
		b.owner_tid = tid;
		b.owner_enter_ts = s->enter_ts;
		if (kind == PG_FILE && !s->cur.direct) {
			b.inode = pino;
			b.offset = poff;
			b.has_offset = 1;
		} else if (kind == PG_OTHER || s->cur.direct) {
			/* direct I/O: the syscall's file, bios queued in file order */
			b.inode = s->cur.inode;
			if (s->cur.has_offset) {
				b.offset = s->cur.offset + s->dio_queued;
				b.has_offset = 1;
			}
			s->dio_queued += bh.size;
		}
		/* PG_BDEV: metadata I/O done for the syscall: no file */
	} else {
		struct ident *w = NULL;

		current_ident(&b.id);
		if (kind == PG_FILE) {
			b.inode = pino;
			b.offset = poff;
			b.has_offset = 1;
			w = bpf_map_lookup_elem(&inode_writer, &pino);
		}
		/*
		 * A kernel worker (write-back, read-ahead): not the kworker but the
		 * task that dirtied the file, and the cgroup that owns the bio.
		 */
		{
			struct task_struct *t = (struct task_struct *)bpf_get_current_task();

			if (BPF_CORE_READ(t, flags) & VT_PF_KTHREAD) {
				__u64 cg = bio_cgroup_id(bio);

				if (w)
					b.id = *w;
				if (cg)
					b.id.cgroup_id = cg;
			}
		}
	}
	if (!ident_ok(&b.id))
		return;
	if (s) {
		qbio_put(s, tid, key, &b);
		stat_inc(S_BIO_QUEUED);
		return;
	}
	if (bpf_map_update_elem(&bios, &key, &b, BPF_ANY))
		stat_inc(S_FULL_BIO);
	else
		stat_inc(S_BIO_QUEUED);
}

/* Every mode; in fentry mode only if tb_bio_queue is refused. */
SEC("raw_tp/block_bio_queue")
int bio_queue(unsigned long long *ctx)
{
	bio_queued(TP_BIO_QUEUE_BIO(ctx), false);
	return 0;
}

/* fentry mode: the same, on a typed bio (vmlinux BTF). */
SEC("?tp_btf/block_bio_queue")
int tb_bio_queue(unsigned long long *ctx)
{
	bio_queued(TP_BIO_QUEUE_BIO(ctx), true);
	return 0;
}

/* block_split([q,] split, new_sector): split is the front part, chained to its parent. */
SEC("raw_tp/block_split")
int bio_split(unsigned long long *ctx)
{
	struct bio *split = TP_SPLIT_BIO(ctx);
	__u64 parent = (__u64)BPF_CORE_READ(split, bi_private);
	__u64 key = (__u64)split;
	struct bio_state *p = bpf_map_lookup_elem(&bios, &parent);

	if (!p) {
		/* a bio of the running syscall: the split part joins its ring */
		__u32 tid = (__u32)bpf_get_current_pid_tgid();
		struct sys_state *s = sys_get(&tid);
		int i = qbio_find(s, parent);
		struct bio_state b = {};
		struct qbio *q;

		if (!s || i < 0 || i >= QBIOS)
			return 0;
		stat_inc(S_BIO_SPLIT);
		q = &s->qbios[i];
		b.queue_ts = q->queue_ts;
		b.inode = q->inode;
		b.offset = q->offset;
		b.has_offset = q->has_offset;
		b.dev = q->dev;
		if (q->has_offset)
			q->offset += BPF_CORE_READ(split, bi_iter.bi_size);
		qbio_put(s, tid, key, &b);
		return 0;
	}
	stat_inc(S_BIO_SPLIT);
	if (bpf_map_update_elem(&bios, &key, p, BPF_ANY))
		stat_inc(S_FULL_BIO);
	/* the parent keeps the rest: it now starts after the split part */
	if (p->has_offset)
		p->offset += BPF_CORE_READ(split, bi_iter.bi_size);
	return 0;
}

/* A tracked bio merged into an existing request: a bio of the running
 * syscall moves to the `bios` map, where the request's issue finds it. */
static __always_inline void bio_merged(__u64 key, __u32 stat)
{
	__u32 tid;
	struct sys_state *s;
	int i;

	if (bpf_map_lookup_elem(&bios, &key)) {
		stat_inc(stat);
		return;
	}
	tid = (__u32)bpf_get_current_pid_tgid();
	s = sys_get(&tid);
	i = qbio_find(s, key);
	if (!s || i < 0)
		return;
	stat_inc(stat);
	qbio_spill(s, tid, i);
}

SEC("raw_tp/block_bio_backmerge")
int bio_backmerge(unsigned long long *ctx)
{
	bio_merged((__u64)TP_MERGE_BIO(ctx), S_BIO_BACKMERGE);
	return 0;
}

SEC("raw_tp/block_bio_frontmerge")
int bio_frontmerge(unsigned long long *ctx)
{
	bio_merged((__u64)TP_MERGE_BIO(ctx), S_BIO_FRONTMERGE);
	return 0;
}

#endif /* VIOTRACE_GUEST_BIO_H */

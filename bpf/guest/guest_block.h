/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Block layer, requests: inserted, issued, requeued, merged, completed. Raw
 * tracepoints (pointer arguments, CO-RE reads) work in every mode.
 *
 * A request takes the identity of its first tracked bio (guest_bio.h) and
 * absorbs all its bios' state when issued (rq->bio … bi_next chain); its one
 * ring-buffer record is sent when it completes.
 */
#ifndef VIOTRACE_GUEST_BLOCK_H
#define VIOTRACE_GUEST_BLOCK_H

static __always_inline void emit_rq(struct rq_state *st);

/* The task a request is attributed to, and the syscall that caused it. */
static __always_inline void rq_owner(struct rq_state *st, const struct ident *id, __u32 owner_tid,
				     __u64 enter_ts)
{
	st->ev.pid = id->pid;
	st->ev.tid = id->tid;
	st->ev.cgroup_id = id->cgroup_id;
	__builtin_memcpy(st->ev.comm, id->comm, VT_COMM);
	st->ev.ts[P_SYSCALL_ENTER] = enter_ts;
	st->owner_tid = owner_tid;
	st->owner_enter_ts = enter_ts;
}

/* A state for request `key`, which has none: its slot if free (a slot never
 * used is zero), else an entry of the hash map. */
static __always_inline struct rq_state *rq_new(__u64 *key)
{
	struct rq_slot *sl = dm_claim(&rq_slots, &rq_claims, RQ_SLOTS, *key);

	return sl ? &sl->st : map_insert(&rqs, key, &zero_rq, S_FULL_RQ);
}

/* chain_bio_g's answer for a bio that the `bios` map tracks. */
#define CHAIN_TRACKED QBIOS

/*
 * What one bio of a request's chain is: its slot among the queued bios of
 * thread `tid`'s running syscall, CHAIN_TRACKED when the `bios` map has it, else
 * -1. Global, so verified once: inlined, the slot scan multiplied the paths of
 * rq_track_g's chain walk by QBIOS at each of its CHAIN_MAX steps.
 */
__noinline int chain_bio_g(__u64 bio, __u32 tid)
{
	struct sys_state *s = sys_get(&tid);
	int qi = qbio_find(s, bio);

	if (s && qi >= 0 && qi < QBIOS)
		return qi;
	return bpf_map_lookup_elem(&bios, &bio) ? CHAIN_TRACKED : -1;
}

/*
 * The rest of rq_track_g, for request `rq` (not live) whose chain walk ended on
 * `bio` with chain_bio_g's answer `r` (-1: no tracked bio); `rq_queue`: its queue.
 * Identity: the first tracked bio in its chain; for a request without tracked
 * bios (flush), the traced syscall running now, if any; `tid`: the current
 * thread. Returns 1 when the request is tracked from now on.
 */
__noinline int rq_track_new_g(__u64 rq, __u64 bio, int r, __u64 rq_queue, __u32 tid)
{
	__u64 key = rq;
	struct rq_state *st = rq_find(&key);
	/* the running syscall, whose queued bios are most requests' first ones */
	struct sys_state *s = sys_get(&tid);
	struct bio_state *first = NULL;
	struct qbio *q = NULL;
	struct gendisk *disk;
	__u32 dev;

	if (s && r >= 0 && r < QBIOS)
		q = &s->qbios[r];
	else if (r == CHAIN_TRACKED)
		first = bpf_map_lookup_elem(&bios, &bio);
	/* a tracked bio names the disk (and passed its filter); else read it */
	if (q) {
		dev = q->dev;
	} else if (first) {
		dev = first->dev;
	} else {
		disk = rq_disk_of((struct request *)rq, (void *)rq_queue);
		if (!disk_ok(disk))
			return 0;
		dev = disk_dev(disk);
	}
	if (!first && !s && task_filter_on())
		return 0;
	if (st)
		__builtin_memset(st, 0, sizeof(*st));
	else
		st = rq_new(&key);
	if (!st)
		return 0;
	st->active = 1;
	st->ev.kind = K_RQ;
	st->ev.dev = dev;
	if (q && s) {
		rq_owner(st, &s->id, tid, s->enter_ts);
		st->ev.inode = q->inode;
		st->ev.file_offset = q->offset;
		st->ev.has_file_offset = q->has_offset;
		st->ev.ts[P_BIO_QUEUE] = q->queue_ts;
		st->first_bio = q->bio;
		q->bio = 0;
	} else if (first) {
		rq_owner(st, &first->id, first->owner_tid, first->owner_enter_ts);
		st->ev.inode = first->inode;
		st->ev.file_offset = first->offset;
		st->ev.has_file_offset = first->has_offset;
	} else if (s) {
		rq_owner(st, &s->id, tid, s->enter_ts);
		st->ev.inode = s->inode;
	}
	return 1;
}

/*
 * Tracks request `rq` from its first sight (insert, issue or queue_rq): 1 when
 * it is tracked. `bio`, `biotail`, `q`: its head, when the caller has it
 * (typed, tb_rq_insert / tb_rq_issue); `q` 0: read here, if the request is new.
 * Global functions (this one, chain_bio_g, rq_track_new_g) are
 * verified once each, on their own: inlined in four programs, the chain walk
 * and what follows it were verified once per exit of the walk, and were most of
 * the guest agent's start-up (seconds per program under TCG).
 */
__noinline int rq_track_g(__u64 rq, __u64 bio_first, __u64 biotail, __u64 q)
{
	__u64 key = rq;
	struct rq_state *live = rq_get(&key);
	struct bio *bio;
	__u32 tid;
	int r = -1;

	if (live) {
		if (!live->ev.ts[P_RQ_COMPLETE])
			return 1;
		/* the tag was reused: the previous use completed unseen by the emitter */
		stat_inc(S_RQ_LATE);
		emit_rq(live);
	}
	if (!q) {
		struct rq_head h;

		if (!rq_head_read((struct request *)rq, &h))
			return 0;
		bio_first = (__u64)h.bio;
		biotail = (__u64)h.biotail;
		q = (__u64)h.q;
	}
	/* (asked here: a live request, the issue's usual case, needs no thread) */
	tid = (__u32)bpf_get_current_pid_tgid();
	bio = (struct bio *)bio_first;
	for (int i = 0; i < CHAIN_MAX && bio; i++) {
		r = chain_bio_g((__u64)bio, tid);
		if (r >= 0 || (__u64)bio == biotail)
			break;
		bio = BPF_CORE_READ(bio, bi_next);
	}
	return rq_track_new_g(rq, r >= 0 ? (__u64)bio : 0, r, q, tid);
}

/* Adds a reference to this request to the syscall that caused it. */
static __always_inline void add_ref(__u32 owner_tid, __u64 owner_enter_ts, struct rq_state *st)
{
	struct sys_state *s = sys_get(&owner_tid);
	__u32 n;

	if (!s || s->enter_ts != owner_enter_ts)
		return;
	n = s->nrefs;
	/* (each bio of this syscall in a request comes here: the request counts
	 * once, listed or not) */
	if ((n || s->refs_dropped) && s->last_ref_sector == st->ev.sector &&
	    s->last_ref_dev == st->ev.dev)
		return;
	s->last_ref_sector = st->ev.sector;
	s->last_ref_dev = st->ev.dev;
	if (n >= VT_MAX_REFS) {
		s->refs_dropped++;
		stat_inc(S_REFS_TRUNC);
		return;
	}
	s->refs[n].sector = st->ev.sector;
	s->refs[n].dev = st->ev.dev;
	s->refs[n].bytes = st->ev.bytes;
	s->nrefs = n + 1;
}

/* Request `rq` absorbs the state of `bio`, one of its chain (global: verified
 * once, not at each of rq_absorb's CHAIN_MAX steps). */
__noinline int absorb_bio_g(__u64 rq, __u64 bio)
{
	__u64 key = rq;
	struct rq_state *st = rq_get(&key);
	struct bio_state *b;

	/* the one taken from the syscall's queued bios has no map entry */
	if (!st || bio == st->first_bio)
		return 0;
	b = bpf_map_lookup_elem(&bios, &bio);
	if (!b)
		return 0;
	if (!st->ev.ts[P_BIO_QUEUE] || b->queue_ts < st->ev.ts[P_BIO_QUEUE])
		st->ev.ts[P_BIO_QUEUE] = b->queue_ts;
	if (b->owner_tid &&
	    (b->owner_tid != st->owner_tid || b->owner_enter_ts != st->owner_enter_ts))
		add_ref(b->owner_tid, b->owner_enter_ts, st);
	bpf_map_delete_elem(&bios, &bio);
	return 1;
}

/* At issue: final geometry `h`, and request `rq` absorbs its bios' state.
 * h->biotail NULL: not known, the chain ends at a NULL bi_next. */
static __always_inline void rq_absorb(__u64 rq, struct rq_state *st, const struct rq_head *h)
{
	struct bio *bio = h->bio;
	__u32 n = 0;
	int i;

	st->ev.sector = h->sector;
	st->ev.bytes = h->bytes;
	st->ev.cmd_flags = h->cmd_flags;
	if (st->owner_tid)
		add_ref(st->owner_tid, st->owner_enter_ts, st);
	for (i = 0; i < CHAIN_MAX && bio; i++) {
		n++;
		/* (the syscall's own bio, taken at tracking, has no state: the
		 * usual single-bio request makes no call) */
		if ((__u64)bio != st->first_bio)
			absorb_bio_g(rq, (__u64)bio);
		/* the last one's bi_next is NULL: not read (one probe read less
		 * for the usual single-bio request) */
		if (bio == h->biotail) {
			bio = NULL;
			break;
		}
		bio = BPF_CORE_READ(bio, bi_next);
	}
	if (bio)
		stat_inc(S_CHAIN_TRUNC);
	st->ev.bios = n;
}

/* rq_issued_g's flags, in the low bits of the request's address (8-aligned) */
#define RQF_ISSUED 1	/* g.rq_issue: now (not when tracked from its virtqueue add) */
#define RQF_HEAD 2	/* the caller gives the head: bio, sector, bytes | cmd_flags << 32 */
#define RQF_SINGLE 4	/* ... and `bio` is the request's only one */
#define RQF_MASK 7ULL

/*
 * At issue: the issue's points, then rq_absorb, for request `rqf` & ~RQF_MASK
 * (flags RQF_*; without RQF_HEAD the head is read here). Global (verified once,
 * see rq_track_g), so it looks the state up itself: a global function takes
 * no map value on 5.10, and at most five numbers. Inlined in its two callers
 * instead, the object took 6k more verified instructions (90k) and 0.9 s
 * longer to load under TCG.
 */
__noinline int rq_issued_g(__u64 rqf, __u64 queued, __u64 bio, __u64 sector, __u64 len_flags)
{
	__u64 key = rqf & ~RQF_MASK;
	struct rq_state *st = rq_get(&key);
	struct rq_head h = {};

	if (!st)
		return 0;
	if (rqf & RQF_ISSUED)
		st->ev.ts[P_RQ_ISSUE] = bpf_ktime_get_ns();
	if (queued)
		st->ev.ts[P_QUEUE_RQ] = queued;
	if (rqf & RQF_HEAD) {
		h.bio = (struct bio *)bio;
		h.biotail = (rqf & RQF_SINGLE) ? h.bio : NULL;
		h.sector = sector;
		h.bytes = (__u32)len_flags;
		h.cmd_flags = len_flags >> 32;
	} else if (!rq_head_read((struct request *)key, &h)) {
		return 1;
	}
	rq_absorb(key, st, &h);
	return 1;
}

/* The state of request `key` with head `bio`, `tail`, `q` (`q` 0: not given,
 * see rq_track_g), tracked from now on if it was not (NULL: not traced). */
static __always_inline struct rq_state *rq_tracked_head(__u64 key, __u64 bio, __u64 tail,
							__u64 q)
{
	return rq_track_g(key, bio, tail, q) ? rq_get(&key) : NULL;
}

/* The same, the head read if needed. */
static __always_inline struct rq_state *rq_tracked(struct request *rq)
{
	return rq_tracked_head((__u64)rq, 0, 0, 0);
}

/* g.rq_insert, for the raw and the typed program. */
static __always_inline void rq_inserted(struct rq_state *st)
{
	if (st)
		st->ev.ts[P_RQ_INSERT] = bpf_ktime_get_ns();
}

/* Every mode; in fentry mode only if tb_rq_insert is refused. */
SEC("raw_tp/block_rq_insert")
int BPF_PROG(rq_insert, struct request *rq)
{
	rq_inserted(rq_tracked(rq));
	return 0;
}

/* Every mode; in fentry mode only if tb_rq_issue is refused. */
SEC("raw_tp/block_rq_issue")
int BPF_PROG(rq_issue, struct request *rq)
{
	int tracked = rq_track_g((__u64)rq, 0, 0, 0);
	__u64 queued = cpu_stamp_get(&queue_rq_stamps, rq, 0, true);

	if (tracked)
		rq_issued_g((__u64)rq | RQF_ISSUED, queued, 0, 0, 0);
	return 0;
}

/*
 * fentry mode (5.11+): the same on a typed request, whose head is plain loads
 * where the raw programs make a probe read at the insert and one at the issue.
 */
SEC("?tp_btf/block_rq_insert")
int BPF_PROG(tb_rq_insert, struct request *rq)
{
	struct typed_base tb = typed_base();

	rq_inserted(rq_tracked_head(typed_addr(&tb, rq), typed_addr(&tb, rq->bio),
				    typed_addr(&tb, rq->biotail), typed_addr(&tb, rq->q)));
	return 0;
}

SEC("?tp_btf/block_rq_issue")
int BPF_PROG(tb_rq_issue, struct request *rq)
{
	struct typed_base tb = typed_base();
	__u64 key = typed_addr(&tb, rq);
	__u64 bio = typed_addr(&tb, rq->bio);
	__u64 tail = typed_addr(&tb, rq->biotail);
	__u64 queued = cpu_stamp_get(&queue_rq_stamps, (void *)key, 0, true);

	if (!rq_track_g(key, bio, tail, typed_addr(&tb, rq->q)))
		return 0;
	rq_issued_g(key | RQF_ISSUED | RQF_HEAD | (bio == tail ? RQF_SINGLE : 0), queued, bio,
		    rq->__sector, rq->__data_len | (__u64)rq->cmd_flags << 32);
	return 0;
}

SEC("raw_tp/block_rq_requeue")
int BPF_PROG(rq_requeue, struct request *rq)
{
	__u64 key = (__u64)rq;

	if (rq_get(&key))
		stat_inc(S_RQ_REQUEUE);
	return 0;
}

/* A request merged into another one: its bios now belong to that one. */
SEC("raw_tp/block_rq_merge")
int BPF_PROG(rq_merge, struct request *rq)
{
	__u64 key = (__u64)rq;
	struct rq_state *st = rq_get(&key);

	if (st) {
		st->active = 0;
		stat_inc(S_RQ_MERGED);
	}
	return 0;
}

static __always_inline void emit_rq(struct rq_state *st)
{
	struct vt_rq_event *e;

	/* (a request listed for its kick has its stamp already, kick_pend_stamp_g;
	 * with --exact-kick the ring may have the notification's time for it) */
	if (have_kick && st->vq && (!st->ev.ts[P_KICK] || have_notify)) {
		__u64 vk = (__u64)st->vq;
		struct vq_state *v = vq_find(&vk);

		if (v) {
			__u64 seq = st->kick_seq + 1;
			struct kick_slot *k = &v->slots[seq & (KICK_SLOTS - 1)];

			if (k->seq == seq) {
				rq_set_kick(st, k->ts, k->notified);
			} else if (k->seq > seq) {
				/* a later kick took the slot: the stamp of its own kick,
				 * unless the request was not listed for it */
				if (!st->ev.ts[P_KICK])
					stat_inc(S_KICK_LOST);
			} else {
				/* done before its batch's kick was recorded */
				stat_inc(S_KICK_AFTER_DONE);
			}
		}
	}
	/*
	 * The record is the state's event as it stands, copied by the program (8-byte
	 * moves): bpf_ringbuf_output's kernel memcpy is a `rep movsb` where the CPU
	 * has ERMS, which emulators run a byte at a time.
	 */
	e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (e) {
		__builtin_memcpy(e, &st->ev, sizeof(*e));
		bpf_ringbuf_submit(e, rb_flags_counted(S_RQ_EMITTED));
	} else {
		stat_inc(S_RB_DROP_RQ);
	}
	st->active = 0;
}

/* block_rq_complete(rq, error, nr_bytes) */
SEC("raw_tp/block_rq_complete")
int BPF_PROG(rq_complete, struct request *rq, int error, unsigned int nr_bytes)
{
	__u64 key = (__u64)rq;
	struct rq_state *st = rq_get(&key);

	if (!st)
		return 0;
	st->ev.ts[P_RQ_COMPLETE] = bpf_ktime_get_ns();
	st->ev.status = error & 0xff;
	/*
	 * Without a hook after the bios end, emit when the last bytes complete.
	 * Also when the driver completion was not seen although hooked: kprobes
	 * nested in another BPF kprobe are skipped by the kernel, so the later
	 * blk_update_request return would likely be missed as well.
	 */
	bool unseen = have_driver_complete && !st->ev.ts[P_DRIVER_COMPLETE];

	if (!(emit_at_rq_complete || unseen) || nr_bytes < BPF_CORE_READ(rq, __data_len))
		return 0;
	/* (kernels before 6.7 do not count the skipped run in the program's
	 * misses, bpf_runs_lost: this counts what it cost) */
	if (unseen && st->ev.ts[P_VQ_ADD])
		stat_inc(S_DRIVER_UNSEEN);
	emit_rq(st);
	return 0;
}

/* fentry/kprobe modes: blk_update_request returned false = all bios ended. */
static __always_inline void update_done(__u64 key, bool more)
{
	struct rq_state *st;

	if (more)
		return;
	st = rq_get(&key);
	if (!st)
		return;
	if (st->ev.bios)
		st->ev.ts[P_BIO_COMPLETE] = bpf_ktime_get_ns();
	emit_rq(st);
}

SEC("?fexit/blk_update_request")
int BPF_PROG(fx_update_request, struct request *rq, int error, unsigned int nr_bytes, bool ret)
{
	update_done(arg_key(ctx, 0, rq), ret);
	return 0;
}

SEC("?kprobe/blk_update_request")
int BPF_KPROBE(kp_update_request, struct request *rq)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	__u64 key = (__u64)rq;

	if (!rq_get(&key))
		return 0;
	if (bpf_map_update_elem(&update_args, &tid, &key, BPF_ANY))
		stat_inc(S_FULL_ARGS);
	return 0;
}

SEC("?kretprobe/blk_update_request")
int BPF_KRETPROBE(krp_update_request, bool ret)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	__u64 *rq = bpf_map_lookup_elem(&update_args, &tid);

	if (!rq)
		return 0;
	update_done(*rq, ret);
	bpf_map_delete_elem(&update_args, &tid);
	return 0;
}

#endif /* VIOTRACE_GUEST_BLOCK_H */

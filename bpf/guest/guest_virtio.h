/* SPDX-License-Identifier: GPL-2.0 */
/*
 * virtio-blk and virtio_ring (modules in most guests: CO-RE and attach targets
 * resolve against module BTF). Each hook has a fentry/fexit and a kprobe
 * flavour; all are optional ("?") and userspace enables one flavour.
 *
 *   virtio_queue_rq / virtio_queue_rqs  g.queue_rq (both blk-mq submit paths)
 *   virtqueue_add_sgs                   g.vq_add, queue index, descriptor head
 *   virtqueue_kick_prepare (return)     kick sequence; notify or suppressed; g.kick
 *   virtqueue_notify                    g.kick's exact time (only with --exact-kick)
 *   vring_interrupt                     interrupt time, stamped per CPU (fentry
 *                                       mode: the irq_handler_entry tracepoint,
 *                                       tb_irq_entry, where this kernel names
 *                                       every virtio handler)
 *   blk_mq_complete_request             g.driver_complete (+ g.irq: this CPU's stamp)
 *
 * Kicks are per virtqueue (many adds, one kick): each vq keeps a kick sequence
 * number and a ring of recent kicks; a request remembers the sequence at add
 * time and takes the next kick from the ring when it is emitted (with
 * --exact-kick, the ring has virtqueue_notify's time). The kick also stamps
 * itself into the requests added for it (kick_pend_add, kick_pend_stamp_g): a
 * long request whose slot a later kick took keeps that stamp.
 */
#ifndef VIOTRACE_GUEST_VIRTIO_H
#define VIOTRACE_GUEST_VIRTIO_H

/* g.queue_rq: block_rq_issue, inside this call, takes the stamp (rq_issue). */
static __always_inline void on_queue_rq(struct request *rq)
{
	cpu_stamp_set(&queue_rq_stamps, rq);
}

struct queue_rqs_walk {
	struct request *rq;
	__u64 now;
};

static long queue_rqs_one(__u64 i, void *data)
{
	struct queue_rqs_walk *w = data;
	struct request *rq = w->rq;
	struct rq_state *st;

	if (!rq)
		return 1;
	st = rq_tracked(rq);
	if (st)
		st->ev.ts[P_QUEUE_RQ] = w->now;
	w->rq = BPF_CORE_READ(rq, rq_next);
	return 0;
}

/* virtio_queue_rqs(struct request **rqlist) (≤6.10) or (struct rq_list *): the
 * first word is the list head either way; requests are linked by rq_next.
 * bpf_loop (5.17+; virtio_queue_rqs is 5.19+): the callback is verified once, not
 * once per list position. */
static __always_inline void on_queue_rqs(void *list)
{
	struct queue_rqs_walk w = { .now = bpf_ktime_get_ns() };

	if (!bpf_core_field_exists(w.rq->rq_next))
		return;
	bpf_probe_read_kernel(&w.rq, sizeof(w.rq), list);
	bpf_loop(CHAIN_MAX, queue_rqs_one, &w, 0);
}

/* The state of virtqueue `key`, created on first sight: its slot if free, else
 * an entry of the hash map (as rq_new, for requests). */
static __always_inline struct vq_state *vq_get_or_create(__u64 *key)
{
	struct vq_state *v = vq_find(key);
	struct vq_slot *sl;

	if (v)
		return v;
	sl = dm_claim(&vq_slots, &vq_claims, VQ_SLOTS, *key);
	return sl ? &sl->v : map_create(&vqs, key, &zero_vq, S_FULL_VQ);
}

/* Request `rq`, just added to queue `v`, waits for the queue's next kick. The
 * driver adds and prepares the kick under the queue's lock: no other CPU
 * changes the list meanwhile. */
static __always_inline void kick_pend_add(struct vq_state *v, __u64 rq)
{
	__u64 want = v->kick_seq + 1;
	__u64 n = v->npend;

	if (v->pend_seq != want) {	/* kicked since the list was filled: a new list */
		v->pend_seq = want;
		n = 0;
	}
	if (n < KICK_PEND)
		v->pend[n & (KICK_PEND - 1)] = rq;
	v->npend = n + 1;
}

/*
 * Kick `seq` of queue `vk` (at `ts`) into the requests listed for it that are
 * still in flight (those emitted already took it from the ring, or were done
 * before it). Global, so that its loop is verified once, not in each of the
 * four programs that kick or notify; it looks the queue up itself (a global
 * function takes no map value on 5.10).
 */
__noinline int kick_pend_stamp_g(__u64 vk, __u64 seq, __u64 ts, __u32 notified)
{
	struct vq_state *v = vq_find(&vk);
	__u64 n;

	if (!v || v->pend_seq != seq)
		return 0;
	n = v->npend;
	for (int i = 0; i < KICK_PEND; i++) {
		__u64 key;
		struct rq_state *st;

		if (i >= n)
			break;
		key = v->pend[i];
		st = rq_get(&key);
		if (st && (__u64)st->vq == vk && st->kick_seq + 1 == seq)
			rq_set_kick(st, ts, notified);
	}
	return 0;
}

/* `index`: the queue's index (a plain load where vq is typed); `vdev`: its
 * device (0: not read) */
static __always_inline void on_add_sgs(struct virtqueue *vq, __u64 vk, void *data, __u32 index,
				       __u64 vdev)
{
	/* virtblk_req is the request's pdu: it directly follows struct request */
	__u64 key = (__u64)data - bpf_core_type_size(struct request);
	struct rq_state *st = rq_get(&key);
	struct vq_state *v;
	__u16 head = 0;
	__u64 queued = 0;

	if (!st) {
		/*
		 * Not tracked: block_rq_issue's program did not run for it (the kernel
		 * skips a run that would nest in another on the same CPU, counted in
		 * bpf_runs_lost, or the agent was still attaching). When
		 * virtio_queue_rq stamped exactly this request on this CPU, it is a
		 * virtio-blk request: it is tracked from here instead of being lost.
		 */
		queued = cpu_stamp_get(&queue_rq_stamps, (void *)key, 0, true);
		if (!queued)
			return;
		st = rq_tracked((struct request *)key);
		if (!st)
			return;
	}
	/*
	 * Never issued in block_rq_issue's program (tracked just above, by
	 * virtio_queue_rqs' walk, or at its insert): its geometry and bios are
	 * taken here, as it goes to the device (else its record would say sector
	 * 0, 0 bytes, a read); g.rq_issue stays absent, and is counted.
	 */
	if (!st->ev.ts[P_RQ_ISSUE]) {
		rq_issued_g(key, queued, 0, 0, 0);
		stat_inc(S_RQ_ISSUE_UNSEEN);
	}
	st->ev.ts[P_VQ_ADD] = bpf_ktime_get_ns();
	st->ev.queue = index;
	st->ev.has_queue = 1;
	/* split ring: the chain's head descriptor; packed ring: the buffer id */
	if (vq_free_head(vq, &head)) {
		st->ev.head = head;
		st->ev.has_head = 1;
	}
	st->vq = vq;
	st->vdev = vdev;
	if (!have_kick)
		return;
	v = vq_get_or_create(&vk);
	st->kick_seq = v ? v->kick_seq : 0;
	if (v)
		kick_pend_add(v, key);
}

static __always_inline void on_kick_prepare(__u64 vk, bool notify)
{
	struct vq_state *v = vq_find(&vk);
	struct kick_slot *k;
	__u64 seq;

	if (!v)
		return;
	seq = v->kick_seq + 1;
	k = &v->slots[seq & (KICK_SLOTS - 1)];
	/*
	 * Slot first, sequence last: a completion can interrupt this program (the
	 * device may have taken the batch without waiting for its kick) and must
	 * see either the whole new kick or none of it.
	 */
	k->ts = bpf_ktime_get_ns();
	k->notified = notify;
	k->seq = seq;
	if (v->pend_seq == seq)
		kick_pend_stamp_g(vk, seq, k->ts, notify);
	asm volatile("" ::: "memory");
	v->kick_seq = seq;
}

static __always_inline void on_notify(__u64 vk)
{
	struct vq_state *v = vq_find(&vk);
	struct kick_slot *k;

	if (!v)
		return;
	k = &v->slots[v->kick_seq & (KICK_SLOTS - 1)];
	if (k->seq != v->kick_seq || !k->notified)
		return;
	k->ts = bpf_ktime_get_ns();
	/* (outside the queue's lock: another CPU's add may be starting a new
	 * list; kick_pend_stamp_g takes only requests of this kick) */
	if (v->pend_seq == k->seq)
		kick_pend_stamp_g(vk, k->seq, k->ts, 1);
}

static __always_inline void on_interrupt(void *vq)
{
	cpu_stamp_set(&irq_stamps, vq);
}

static __always_inline void on_driver_complete(__u64 key)
{
	struct rq_state *st = rq_get(&key);
	__u64 irq;

	if (!st)
		return;
	st->ev.ts[P_DRIVER_COMPLETE] = bpf_ktime_get_ns();
	/* called from the vq callback inside vring_interrupt, on this CPU: the
	 * stamp names its vq, or (a shared handler) its device */
	irq = cpu_stamp_get(&irq_stamps, st->vq, st->vdev, false);
	if (irq && irq >= st->ev.ts[P_VQ_ADD])
		st->ev.ts[P_IRQ] = irq;
}

/* ---- fentry / fexit flavour ---- */

SEC("?fentry/virtio_queue_rq")
int BPF_PROG(fe_queue_rq, struct blk_mq_hw_ctx *hctx, const struct blk_mq_queue_data *bd)
{
	/* a typed argument: a plain load, no probe read */
	on_queue_rq(bd->rq);
	return 0;
}

/* Its argument is a pointer to a pointer, which older verifiers refuse to let
 * a tracing program read from the context: bpf_get_func_arg() reads it. */
SEC("?fentry/virtio_queue_rqs")
int fe_queue_rqs(void *ctx)
{
	__u64 list = 0;

	if (bpf_get_func_arg(ctx, 0, &list) == 0)
		on_queue_rqs((void *)list);
	return 0;
}

SEC("?fentry/virtqueue_add_sgs")
int BPF_PROG(fe_add_sgs, struct virtqueue *vq, struct scatterlist **sgs, unsigned int out_sgs,
	     unsigned int in_sgs, void *data)
{
	on_add_sgs(vq, arg_key(ctx, 0, vq), data, vq->index, (__u64)vq->vdev);
	return 0;
}

SEC("?fexit/virtqueue_kick_prepare")
int BPF_PROG(fx_kick_prepare, struct virtqueue *vq, bool ret)
{
	on_kick_prepare(arg_key(ctx, 0, vq), ret);
	return 0;
}

SEC("?fentry/virtqueue_notify")
int BPF_PROG(fe_notify, struct virtqueue *vq)
{
	on_notify(arg_key(ctx, 0, vq));
	return 0;
}

SEC("?fentry/vring_interrupt")
int BPF_PROG(fe_vring_interrupt, int irq, void *vq)
{
	on_interrupt(vq);
	return 0;
}

/*
 * fentry mode: irq_handler_entry, typed, instead of a trampoline on
 * vring_interrupt (a tracepoint's program is entered for less: no
 * trampoline, no migrate_disable). Its action names the handler and its
 * dev_id: vring_interrupt's is the vq (a vector per queue), the shared
 * handlers' is the virtio device (whose struct starts the transport's).
 * Every device interrupt runs it; the others return at the compare.
 */
SEC("?tp_btf/irq_handler_entry")
int BPF_PROG(tb_irq_entry, int irq, struct irqaction *action)
{
	__u64 h = (__u64)action->handler;

	if (h && (h == vring_interrupt_addr || h == vdev_irq_handlers[0] ||
		  h == vdev_irq_handlers[1] || h == vdev_irq_handlers[2]))
		on_interrupt(action->dev_id);
	return 0;
}

SEC("?fentry/blk_mq_complete_request")
int BPF_PROG(fe_complete_request, struct request *rq)
{
	on_driver_complete(arg_key(ctx, 0, rq));
	return 0;
}

/* ---- kprobe flavour ---- */

/*
 * A kprobe that fires while another BPF kprobe program runs on the CPU is
 * skipped by the kernel; a virtqueue interrupt often lands just then. The
 * irq_handler_entry raw tracepoint is not subject to that: with per-virtqueue
 * MSI-X vectors, the action's handler is vring_interrupt and dev_id its vq.
 */
SEC("?raw_tp/irq_handler_entry")
int BPF_PROG(irq_entry, int irq, struct irqaction *action)
{
	if (!vring_interrupt_addr || (__u64)BPF_CORE_READ(action, handler) != vring_interrupt_addr)
		return 0;
	on_interrupt(BPF_CORE_READ(action, dev_id));
	return 0;
}

SEC("?kprobe/virtio_queue_rq")
int BPF_KPROBE(kp_queue_rq, struct blk_mq_hw_ctx *hctx, const struct blk_mq_queue_data *bd)
{
	on_queue_rq(BPF_CORE_READ(bd, rq));
	return 0;
}

SEC("?kprobe/virtio_queue_rqs")
int BPF_KPROBE(kp_queue_rqs, void *list)
{
	on_queue_rqs(list);
	return 0;
}

SEC("?kprobe/virtqueue_add_sgs")
int BPF_KPROBE(kp_add_sgs, struct virtqueue *vq, struct scatterlist **sgs, unsigned int out_sgs,
	       unsigned int in_sgs, void *data)
{
	on_add_sgs(vq, (__u64)vq, data, BPF_CORE_READ(vq, index), 0);
	return 0;
}

SEC("?kprobe/virtqueue_kick_prepare")
int BPF_KPROBE(kp_kick_prepare, struct virtqueue *vq)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	__u64 vk = (__u64)vq;

	if (!vq_find(&vk))
		return 0;
	if (bpf_map_update_elem(&kick_args, &tid, &vk, BPF_ANY))
		stat_inc(S_FULL_ARGS);
	return 0;
}

SEC("?kretprobe/virtqueue_kick_prepare")
int BPF_KRETPROBE(krp_kick_prepare, bool ret)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	__u64 *vq = bpf_map_lookup_elem(&kick_args, &tid);

	if (!vq)
		return 0;
	on_kick_prepare(*vq, ret);
	bpf_map_delete_elem(&kick_args, &tid);
	return 0;
}

SEC("?kprobe/virtqueue_notify")
int BPF_KPROBE(kp_notify, struct virtqueue *vq)
{
	on_notify((__u64)vq);
	return 0;
}

SEC("?kprobe/vring_interrupt")
int BPF_KPROBE(kp_vring_interrupt, int irq, void *vq)
{
	on_interrupt(vq);
	return 0;
}

SEC("?kprobe/blk_mq_complete_request")
int BPF_KPROBE(kp_complete_request, struct request *rq)
{
	on_driver_complete((__u64)rq);
	return 0;
}

#endif

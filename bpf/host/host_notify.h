/* SPDX-License-Identifier: GPL-2.0 */
/* QEMU's notifications: the guest and host notifier eventfds (h.irq, h.notify), virtio_notify (included by viotrace_host.bpf.c, in this order). */
#pragma once

/* The notifier eventfd `fd` of a traced QEMU process, if it is one. Every
 * process's read() and write() pass here, QEMU's several per request: one
 * lookup of the fd, and only on a hit the check that the process is still a
 * traced QEMU (an entry may outlive its process, whose pid may be reused). */
static __always_inline struct fd_val *notifier_of(__u32 tgid, __s32 fd)
{
	struct fd_key k = { .tgid = tgid, .fd = fd };
	struct fd_val *v = bpf_map_lookup_elem(&notifier_fds, &k);

	if (!v || !bpf_map_lookup_elem(&qemu_procs, &tgid))
		return NULL;
	return v;
}

/* QEMU writes the guest notifier eventfd of a queue (event_notifier_set from
 * virtio_notify_irqfd): the guest interrupt, h.irq. */
SEC("tracepoint/syscalls/sys_enter_write")
int irq_write(struct trace_event_raw_sys_enter *ctx)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	struct fd_val *v = notifier_of(tgid, (__s32)ctx->args[0]);
	if (!v || v->kind != FD_IRQ)
		return 0;
	struct vq_state *st = traced_vq(tgid, v->vq);
	if (st) {
		st->irq_by_fd = 1;
		flush_st(tgid, v->vq, st);
	}
	return 0;
}

/* QEMU reads a queue's host notifier eventfd (event_notifier_test_and_clear)
 * before it handles the guest's kick: h.notify. */
SEC("tracepoint/syscalls/sys_enter_read")
int kick_read(struct trace_event_raw_sys_enter *ctx)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	struct fd_val *v = notifier_of(tgid, (__s32)ctx->args[0]);
	if (!v || v->kind != FD_KICK)
		return 0;
	struct vq_state *st = traced_vq(tgid, v->vq);
	if (st) {
		vq_kick(st, bpf_ktime_get_ns());
		stat_inc(ST_KICKS);
	}
	return 0;
}

/* virtio_notify(vdev, vq): the non-dataplane path (early boot, ioeventfd=off)
 * raises the interrupt synchronously without an eventfd. */
SEC("uprobe")
int BPF_KPROBE(notify_direct, void *vdev, void *vq)
{
	stat_inc(ST_UPROBE_HITS);
	stat_inc(ST_NOTIFY_CALLS);
	__u32 tgid;
	struct qemu_layout *l = this_proc(&tgid);
	if (!l)
		return 0;
	struct vq_state *st = traced_vq(tgid, (__u64)vq);
	if (!st)
		return 0;
	/* (counted apart from other devices' calls: the bench's traps per request) */
	stat_inc(ST_NOTIFY_TRACED);
	if (l->flags & QL_HAVE_NOTIFIER)
		flush_st(tgid, (__u64)vq, st);
	return 0;
}


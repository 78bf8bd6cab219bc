/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Kernel differences both BPF objects (guest and host) read around, resolved
 * when the object is loaded (CO-RE; the branch this kernel does not take is
 * dropped by the verifier with its relocations):
 *
 *   request's disk    5.10: rq->rq_disk            5.16+: rq->q->disk
 *   task state        5.10: task->state            5.14+: task->__state
 *   task's CPU        thread_info.cpu (x86 until the field moved) or task->cpu
 */
#ifndef VT_CORE_FIXES_H
#define VT_CORE_FIXES_H

struct request___old {
	struct gendisk *rq_disk;
} __attribute__((preserve_access_index));

struct request_queue___new {
	struct gendisk *disk;
} __attribute__((preserve_access_index));

static __always_inline struct gendisk *rq_disk(struct request *rq)
{
	struct request___old *o = (void *)rq;
	struct request_queue___new *q;

	if (bpf_core_field_exists(struct request_queue___new, disk)) {
		q = (void *)BPF_CORE_READ(rq, q);
		return BPF_CORE_READ(q, disk);
	}
	if (bpf_core_field_exists(o->rq_disk))
		return BPF_CORE_READ(o, rq_disk);
	return NULL;
}

struct task_struct___state_old {
	long state;
} __attribute__((preserve_access_index));

static __always_inline long task_state_of(struct task_struct *t)
{
	if (bpf_core_field_exists(t->__state))
		return BPF_CORE_READ(t, __state);
	return BPF_CORE_READ((struct task_struct___state_old *)t, state);
}

struct task_struct___cpu {
	unsigned int cpu;
} __attribute__((preserve_access_index));

static __always_inline __u32 task_cpu_of(struct task_struct *t)
{
	if (bpf_core_field_exists(t->thread_info.cpu))
		return BPF_CORE_READ(t, thread_info.cpu);
	return BPF_CORE_READ((struct task_struct___cpu *)t, cpu);
}

#endif

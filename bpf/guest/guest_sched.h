/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Off-CPU time of traced syscalls (the guest side of the why-slow verdicts):
 * while a task is inside a traced syscall (sys_inflight), every time it leaves
 * the CPU is accounted as runnable (preempted, waiting for a CPU) or blocked
 * (sleeping: its I/O, a lock) until it runs again; for its longest wait for a
 * CPU, the task that kept it off the CPU is kept: the process that ran most on
 * that CPU since a traced task last got it, else the one running when the wait
 * began. Optional programs ("?"): userspace loads
 * them only for the verdicts (-t); every other task costs one hash lookup per
 * context switch and wakeup.
 */
#pragma once

/* Per CPU: the task running now, and the CPU time of the (at most CANDIDATES)
 * processes that ran most on it since a traced task last got it back: the
 * task that kept a waiting traced task off the CPU is the one that ran most. */
#define MAX_CPUS 256
#define CANDIDATES 4

struct cand {
	__u64 task; /* struct task_struct * (for its name) */
	__u64 ns;
	__u32 tgid;
	__u32 pad;
};

struct cpu_runs {
	__u64 cur_task;
	__u64 cur_since;
	__u32 cur_tgid;
	__u32 pad;
	struct cand k[CANDIDATES];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_CPUS);
	__type(key, __u32); /* CPU */
	__type(value, struct cpu_runs);
} cpu_runs SEC(".maps");

static __always_inline void note_holder(char *comm, __u64 task)
{
	if (task)
		bpf_probe_read_kernel_str(comm, VT_COMM, &((struct task_struct *)task)->comm);
	else
		__builtin_memset(comm, 0, VT_COMM);
}

/* A traced task starts waiting for a CPU behind the task `c` runs now. */
static __always_inline void runq_start(struct sys_state *s, __u64 now, struct cpu_runs *c)
{
	s->off_since = now;
	s->off_runnable = 1;
	s->cur_holder = c ? c->cur_tgid : 0;
	note_holder(s->cur_holder_comm, c ? c->cur_task : 0);
}

/* Adds the run that ends now to its process's candidate (the smallest one
 * makes room for a new process). */
static __always_inline void add_run(struct cpu_runs *c, __u64 now)
{
	__u32 tgid = c->cur_tgid, slot = CANDIDATES, low = 0;
	if (!c->cur_since || !tgid)
		return;
	for (__u32 j = 0; j < CANDIDATES; j++) {
		if (c->k[j].tgid == tgid) {
			slot = j;
			break;
		}
		if (c->k[j].ns < c->k[low & (CANDIDATES - 1)].ns)
			low = j;
	}
	if (slot >= CANDIDATES) {
		slot = low & (CANDIDATES - 1);
		c->k[slot].tgid = tgid;
		c->k[slot].task = c->cur_task;
		c->k[slot].ns = 0;
	}
	c->k[slot & (CANDIDATES - 1)].ns += now - c->cur_since;
}

/* The process (other than `self`) that ran most, and a fresh table. */
static __always_inline struct cand take_top(struct cpu_runs *c, __u32 self)
{
	struct cand best = {};
	for (__u32 j = 0; j < CANDIDATES; j++) {
		if (c->k[j].tgid != self && c->k[j].ns > best.ns)
			best = c->k[j];
	}
	__builtin_memset(c->k, 0, sizeof(c->k));
	return best;
}

SEC("?raw_tp/sched_switch")
int off_cpu_switch(unsigned long long *ctx)
{
	struct task_struct *prev = (void *)ctx[1], *next = (void *)ctx[2];
	__u64 now = bpf_ktime_get_ns();
	__u32 cpu = bpf_get_smp_processor_id();
	struct cpu_runs *c = bpf_map_lookup_elem(&cpu_runs, &cpu);
	if (c) {
		add_run(c, now);
		c->cur_task = (__u64)next;
		c->cur_tgid = BPF_CORE_READ(next, tgid);
		c->cur_since = now;
	}
	__u32 tid = BPF_CORE_READ(prev, pid);
	struct sys_state *s = sys_get(&tid);
	if (s) {
		if (task_state_of(prev) == 0) {
			runq_start(s, now, c);
		} else {
			s->off_since = now;
			s->off_runnable = 0;
		}
	}
	__u32 next_pid = BPF_CORE_READ(next, pid);
	s = sys_get(&next_pid);
	if (!s || !s->off_since)
		return 0;
	__u64 d = now - s->off_since;
	if (s->off_runnable) {
		s->runq_ns += d;
		struct cand b = {};
		if (c)
			b = take_top(c, BPF_CORE_READ(next, tgid));
		if (d > s->best_wait) {
			s->best_wait = d;
			if (b.ns) {
				s->best_holder = b.tgid;
				note_holder(s->best_holder_comm, b.task);
			} else {
				s->best_holder = s->cur_holder;
				__builtin_memcpy(s->best_holder_comm, s->cur_holder_comm, VT_COMM);
			}
		}
	} else {
		s->blocked_ns += d;
	}
	s->off_since = 0;
	return 0;
}

/* Woken: blocked until now, runnable (behind whatever its CPU runs) from now on. */
SEC("?raw_tp/sched_wakeup")
int off_cpu_wakeup(unsigned long long *ctx)
{
	struct task_struct *p = (void *)ctx[0];
	__u32 tid = BPF_CORE_READ(p, pid);
	struct sys_state *s = sys_get(&tid);
	if (!s || !s->off_since || s->off_runnable)
		return 0;
	__u64 now = bpf_ktime_get_ns();
	s->blocked_ns += now - s->off_since;
	__u32 cpu = task_cpu_of(p);
	runq_start(s, now, bpf_map_lookup_elem(&cpu_runs, &cpu));
	return 0;
}

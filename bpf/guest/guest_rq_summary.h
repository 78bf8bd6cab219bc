/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Always-on's request records that no one reads but the tables: a finished
 * request whose (disk, points seen) has a plan is counted here, in the stage
 * histograms' bucket layout, and sends no record.
 *
 * The agent writes the plans (guest-agent/src/rq_summary.rs), and only when no
 * output needs every record (no --json, --capture, --connect or -t). A plan
 * is the agent's own stage partition of that set of points (shared/src/
 * stages.rs): its steps are the stages, and the total, as (from point, to
 * point, row); the agent resolves it from the first record of that set, so
 * the partition has one definition. A row counts one (disk, stage). Anything
 * the plans do not cover (a new set of points, a full table, a stage of 2^31
 * ns or more) sends its record as before; a set the agent cannot count has a
 * plan of no steps. The record of a set whose plan slot is empty wakes the
 * agent, so that the plan is in place within a poll, not a poll period.
 */
#ifndef VIOTRACE_GUEST_RQ_SUMMARY_H
#define VIOTRACE_GUEST_RQ_SUMMARY_H

#define RQ_ROWS 32		/* a power of two: rows are masked for the verifier */
#define RQ_PLANS 16		/* direct-mapped by rq_plan_index() */
#define RQ_PLAN_STEPS 8		/* the guest's stages (at most 6) and the total */

struct rq_plan_step {
	__u8 from;		/* point ids (enum vt_point) */
	__u8 to;
	__u16 row;
};

struct rq_plan {
	__u32 ready;		/* 1 once the rest is written: the agent writes it last */
	__u32 dev;
	__u32 mask;		/* bit i: ts[i] seen */
	__u32 n;		/* steps */
	struct rq_plan_step steps[RQ_PLAN_STEPS];
};

/* The agent writes plans (set at load: records are otherwise all needed). */
const volatile __u32 rq_summary_on = 0;

/* What rq_summarized() did with a request. */
enum rq_summary {
	RQ_SENT = 0,		/* send the record */
	RQ_COUNTED = 1,		/* counted: no record */
	RQ_UNPLANNED = 2,	/* send it, and wake the agent: its slot has no plan yet */
};

struct rq_plan rq_plans[RQ_PLANS];
/* Row r: counts by slot (latencies under 2^31 ns); rq_row_counts[r] is
 * incremented after the slot, rq_row_sums[r] sums the values (ns). */
__u32 rq_rows[RQ_ROWS][IO_ROW_SLOTS];
__u64 rq_row_counts[RQ_ROWS];
__u64 rq_row_sums[RQ_ROWS];

/*
 * The plan slot of (dev, mask): the agent's `plan_index` (rq_summary.rs). A
 * global function: its result is any number to the caller, so the verifier
 * need not keep apart the 2^12 masks the caller's branches make.
 */
__noinline __u32 rq_plan_slot_g(__u32 dev, __u32 mask)
{
	return (((dev ^ (mask * 0x9E3779B1u)) * 0x85EBCA77u) >> 28) & (RQ_PLANS - 1);
}

/* Counts `ns` (< 2^31) in row `row` (verified once, whatever the caller). */
__noinline int rq_row_add_g(__u32 row, __u64 ns)
{
	__u32 slot;

	if (row >= RQ_ROWS || ns >> 31)
		return 0;
	/* (0 in the slot of 1, as the agent's histograms record a value) */
	slot = hist_slot(ns ? ns : 1);
	if (slot >= IO_ROW_SLOTS)
		return 0;
	/* (bounds the verifier sees on the very registers used) */
	asm volatile("" : "+r"(row), "+r"(slot));
	row &= RQ_ROWS - 1;
	if (slot >= IO_ROW_SLOTS)
		return 0;
	__sync_fetch_and_add(&rq_rows[row][slot], 1);
	__sync_fetch_and_add(&rq_row_counts[row], 1);
	__sync_fetch_and_add(&rq_row_sums[row], ns);
	return 1;
}

/* Counts request `st` by its plan: enum rq_summary. */
static __noinline int rq_summarized(struct rq_state *st)
{
	__u64 ns[RQ_PLAN_STEPS];
	__u32 mask = 0, n, i;
	struct rq_plan *p;

#pragma unroll
	for (i = 0; i < P_NR; i++)
		if (st->ev.ts[i])
			mask |= 1U << i;
	p = &rq_plans[rq_plan_slot_g(st->ev.dev, mask) & (RQ_PLANS - 1)];
	if (!*(volatile __u32 *)&p->ready)
		return RQ_UNPLANNED;
	asm volatile("" ::: "memory");
	n = p->n;
	if (p->dev != st->ev.dev || p->mask != mask || !n)
		return RQ_SENT;
	/* Every step's value first: one out of the rows' range sends the record. */
#pragma unroll
	for (i = 0; i < RQ_PLAN_STEPS; i++) {
		__u32 from = p->steps[i].from, to = p->steps[i].to;
		__u64 a, b;

		if (i >= n)
			break;
		if (from >= P_NR || to >= P_NR)
			return RQ_SENT;
		a = st->ev.ts[from];
		b = st->ev.ts[to];
		/* (a negative stage counts as 0, as in the agent's histograms) */
		ns[i] = b > a ? b - a : 0;
		if (ns[i] >> 31)
			return RQ_SENT;
	}
#pragma unroll
	for (i = 0; i < RQ_PLAN_STEPS; i++) {
		if (i >= n)
			break;
		rq_row_add_g(p->steps[i].row, ns[i]);
	}
	return RQ_COUNTED;
}

#endif /* VIOTRACE_GUEST_RQ_SUMMARY_H */

/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Always-on requests without records: the stage histograms counted here.
 *
 * When only the agent's tables read the requests (rq_summarize: no --json,
 * capture, uplink or -t), a finished request is not sent through the ring
 * buffer: its stages go straight into per-(disk, stage) histograms in the
 * layout of the agent's (hist_slot). Which stages a request has depends only
 * on which points it has: the agent resolves that once per presence mask
 * (shared/src/stages.rs, point_plan) into `rq_plans`, so this side only
 * subtracts and counts. A request is sent as before when its mask has no
 * plan, its disk has no rows, or a stage falls outside the rows' slots.
 * The agent reads the rows that moved once an interval (rq_hist.rs).
 */
#ifndef VIOTRACE_GUEST_RQ_STATS_H
#define VIOTRACE_GUEST_RQ_STATS_H

/* 1: summarize requests into rq_hist (set by userspace before load). */
const volatile __u8 rq_summarize = 0;

#define RQ_DISKS 4		/* disks with rows; others send records */
#define RQ_STAGES 16		/* stage ids a guest request can have */
#define RQ_STEPS 6		/* stages of one request: spans and total */
#define RQ_ROWS (RQ_DISKS * RQ_STAGES)
#define RQ_HIST_SLOTS 3200	/* = IO_ROW_SLOTS: latencies below 2^31 ns */

/* The stages of one presence mask (bit i: ts[i] set): step k subtracts
 * ts[from[k]] from ts[to[k]] into stage stage[k]; n = 0: no plan. */
struct rq_plan {
	__u8 n;
	__u8 from[RQ_STEPS];
	__u8 to[RQ_STEPS];
	__u8 stage[RQ_STEPS];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1 << P_NR);
	__type(key, __u32);
	__type(value, struct rq_plan);
} rq_plans SEC(".maps");

struct rq_hist_row {
	__u32 slots[RQ_HIST_SLOTS];
};

/* Row disk * RQ_STAGES + stage: counts by slot (32-bit: the agent takes
 * differences every interval, which wrap correctly). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, RQ_ROWS);
	__type(key, __u32);
	__type(value, struct rq_hist_row);
} rq_hist SEC(".maps");

/* Set by userspace after load (.bss): the disks with rows (dev, 0 = none). */
volatile __u32 rq_disk_devs[RQ_DISKS];
/* Per row: values counted (after the slot), and their sum (ns). */
__u64 rq_row_counts[RQ_ROWS];
__u64 rq_row_sums[RQ_ROWS];

/* The disk's rows, or RQ_DISKS. */
static __always_inline __u32 rq_hist_disk(__u32 dev)
{
#pragma unroll
	for (__u32 i = 0; i < RQ_DISKS; i++) {
		if (rq_disk_devs[i] == dev)
			return i;
	}
	return RQ_DISKS;
}

/*
 * Counts a finished request's stages in rq_hist; false: it was not counted
 * (no plan for its points, a disk without rows, a stage too long) and sends
 * its record.
 */
static __always_inline bool rq_summarized(const struct vt_rq_event *ev)
{
	__u32 mask = 0, disk, n, row;
	__u32 slot[RQ_STEPS];
	__u64 ns[RQ_STEPS];
	struct rq_plan *plan;
	struct rq_hist_row *h;

	if (!rq_summarize || !ev->dev)
		return false;
#pragma unroll
	for (__u32 i = 0; i < P_NR; i++) {
		if (ev->ts[i])
			mask |= 1U << i;
	}
	plan = bpf_map_lookup_elem(&rq_plans, &mask);
	if (!plan || !plan->n)
		return false;
	disk = rq_hist_disk(ev->dev);
	if (disk >= RQ_DISKS)
		return false;
	n = plan->n;
	/* Every slot first: a request is counted whole or not at all. */
#pragma unroll
	for (__u32 k = 0; k < RQ_STEPS; k++) {
		__u32 a = plan->from[k], b = plan->to[k];
		__s64 d;

		if (k >= n)
			break;
		if (a >= P_NR || b >= P_NR || plan->stage[k] >= RQ_STAGES)
			return false;
		d = (__s64)(ev->ts[b] - ev->ts[a]);
		ns[k] = d > 0 ? (__u64)d : 0;
		if (ns[k] >> 31)
			return false;
		slot[k] = hist_slot(ns[k] ? ns[k] : 1);
	}
#pragma unroll
	for (__u32 k = 0; k < RQ_STEPS; k++) {
		if (k >= n)
			break;
		row = disk * RQ_STAGES + plan->stage[k];
		h = bpf_map_lookup_elem(&rq_hist, &row);
		if (!h || row >= RQ_ROWS || slot[k] >= RQ_HIST_SLOTS)
			continue;	/* (cannot happen: checked above) */
		__sync_fetch_and_add(&h->slots[slot[k]], 1);
		__sync_fetch_and_add(&rq_row_sums[row], ns[k]);
		__sync_fetch_and_add(&rq_row_counts[row], 1);
	}
	stat_inc(S_RQ_SUMMARIZED);
	return true;
}

#endif

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
#define RQ_ROWS (RQ_DISKS * RQ_STAGES)	/* a power of two (rq_count) */
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

/* floor(log2(b)) of each byte value b >= 1. */
#define L16(x) x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x
static const __u8 log2_byte[256] = {
	0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, L16(4), L16(5), L16(5),
	L16(6), L16(6), L16(6), L16(6), L16(7), L16(7), L16(7), L16(7), L16(7), L16(7), L16(7), L16(7),
};
#undef L16

/*
 * hist_slot of 0 <= ns < 2^31 (0 counts as 1, as the agent's tables count
 * it) without a branch: x >= 1 is ((x + 2^k - 1) >> k) for x < 2^k. With
 * branches, six of these in one program are 2^30 paths to the verifier.
 */
static __always_inline __u64 rq_slot(__u64 ns)
{
	__u64 v, s, r;

	ns += (ns - 1) >> 63;	/* 0 -> 1 */
	v = ns | 255;
	s = (((v >> 16) + 0xffff) >> 16) << 4;
	v >>= s;
	r = s;
	s = (((v >> 8) + 0xff) >> 8) << 3;
	v >>= s;
	r += s + log2_byte[v & 255] - 7;	/* the bucket: floor(log2(ns | 255)) - 7 */
	return ((r + 1) << 7) + (ns >> r) - 128;
}

/* Step k's value: ts[to] - ts[from], 0 when negative; ~0 when it cannot be
 * counted (a bad plan, 2^31 ns or more). */
static __always_inline __u64 rq_step_ns(const struct vt_rq_event *ev, const struct rq_plan *plan,
					__u32 k)
{
	__u32 a = plan->from[k], b = plan->to[k];
	__s64 d;

	if (a >= P_NR || b >= P_NR)
		return ~0ULL;
	d = (__s64)(ev->ts[b] - ev->ts[a]);
	return (__u64)(d & ~(d >> 63));
}

/* Counts step k's value in its row: the slot, then the row's sum and count. */
static __always_inline void rq_count(const struct rq_plan *plan, __u32 k, __u32 disk, __u64 ns)
{
	__u32 row = disk * RQ_STAGES + plan->stage[k];
	struct rq_hist_row *h;
	__u64 slot = rq_slot(ns);

	h = bpf_map_lookup_elem(&rq_hist, &row);
	/* Bounded where the verifier sees them: a bound checked on another
	 * copy (or before a spill) is lost to it. (The row is below RQ_ROWS
	 * already: it indexes the .bss arrays too.) */
	asm volatile("" : "+r"(slot));
	if (!h || slot >= RQ_HIST_SLOTS)
		return;	/* (cannot happen: ns < 2^31) */
	asm volatile("" : "+r"(row));
	row &= RQ_ROWS - 1;
	__sync_fetch_and_add(&h->slots[slot], 1);
	__sync_fetch_and_add(&rq_row_sums[row], ns);
	__sync_fetch_and_add(&rq_row_counts[row], 1);
}

/*
 * Counts a finished request's stages in rq_hist; false: it was not counted
 * (no plan for its points, a disk without rows, a stage of 2^31 ns or more)
 * and sends its record. Steps written out, not looped: older verifiers
 * refuse loops.
 */
static __always_inline bool rq_summarized(const struct vt_rq_event *ev)
{
	__u32 mask = 0, disk, n;
	__u64 ns[RQ_STEPS] = {};
	struct rq_plan *plan;

	if (!rq_summarize || !ev->dev)
		return false;
#pragma unroll
	for (__u32 i = 0; i < P_NR; i++) {
		if (ev->ts[i])
			mask |= 1U << i;
	}
	plan = bpf_map_lookup_elem(&rq_plans, &mask);
	if (!plan || !plan->n || plan->n > RQ_STEPS)
		return false;
	disk = rq_hist_disk(ev->dev);
	if (disk >= RQ_DISKS)
		return false;
	n = plan->n;
	/* Every value first: a request is counted whole or not at all. */
#define RQ_STEP(k)                                                         \
	if (n > k) {                                                       \
		ns[k] = rq_step_ns(ev, plan, k);                           \
		if (ns[k] >> 31 || plan->stage[k] >= RQ_STAGES)            \
			return false;                                      \
	}
	RQ_STEP(0) RQ_STEP(1) RQ_STEP(2) RQ_STEP(3) RQ_STEP(4) RQ_STEP(5)
#undef RQ_STEP
#define RQ_COUNT(k) \
	if (n > k)  \
		rq_count(plan, k, disk, ns[k]);
	RQ_COUNT(0) RQ_COUNT(1) RQ_COUNT(2) RQ_COUNT(3) RQ_COUNT(4) RQ_COUNT(5)
#undef RQ_COUNT
	_Static_assert(RQ_STEPS == 6, "one RQ_STEP and RQ_COUNT per step");
	_Static_assert((RQ_ROWS & (RQ_ROWS - 1)) == 0, "RQ_ROWS is a power of two");
	stat_inc(S_RQ_SUMMARIZED);
	return true;
}

#endif

/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The request table without request records: always-on with nothing else
 * reading the records (no --connect, --json, capture or -t), a finished
 * request's stages are counted here, in the bucket layout of the agent's stage
 * histograms, instead of its record going to userspace. The agent's request
 * table then has the same counts and sums as if it had had every record
 * (guest-agent/src/rq_table.rs reads them once an interval).
 *
 * The agent says what to count, learned from records: for each disk it names
 * (`rq_table_devs`) and each presence mask of a record's ts[] (bit i: ts[i]
 * set), the stages its statistics record for such a record — computed by its
 * own stage code, shared/src/stages.rs — as (start slot, end slot, row).
 * A request whose disk or mask has no plan yet, or one of whose stages falls
 * past a row's slots, sends its record as before; the agent then sets up what
 * was missing, so the next request like it is counted here.
 */
#ifndef VIOTRACE_GUEST_RQ_TABLE_H
#define VIOTRACE_GUEST_RQ_TABLE_H

/* 1: count requests here when the agent has set them up (else every request sends its record). */
const volatile __u8 rq_table_on = 0;

#define RQ_TABLE_DISKS 4
#define RQ_TABLE_ROWS 32
/* Slots per row: stages under 2^26 ns (67 ms); a request with a longer one sends its record. */
#define RQ_ROW_SLOTS 2560
/* A guest record has at most 7 anchors: 6 stages and the total. */
#define RQ_PLAN_STEPS 8

struct rq_plan {
	__u8 n;				/* steps; 0: not set up */
	__u8 from[RQ_PLAN_STEPS];	/* ts[] slot where the stage starts */
	__u8 to[RQ_PLAN_STEPS];		/* ... and ends */
	__u8 row[RQ_PLAN_STEPS];	/* its row in rq_rows, + 1 */
};

/* Key: disk index << P_NR | mask. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, RQ_TABLE_DISKS << P_NR);
	__type(key, __u32);
	__type(value, struct rq_plan);
} rq_plans SEC(".maps");

/* The disks (dev_t as in the records, 0: none), by index; written by the agent. */
struct rq_table_disks {
	__u32 dev[RQ_TABLE_DISKS];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rq_table_disks);
} rq_table_devs SEC(".maps");

/* One (disk, stage)'s counts by slot, and the sum of its values (ns). */
struct rq_row {
	__u64 sum;
	__u32 slots[RQ_ROW_SLOTS];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, RQ_TABLE_ROWS);
	__type(key, __u32);
	__type(value, struct rq_row);
} rq_rows SEC(".maps");

/* Never used: give the two value types a place in the object's BTF (see
 * vt_io_event_btf), for the agent's generated Rust types. */
struct rq_plan *rq_plan_btf;
struct rq_row *rq_row_btf;

/* Requests counted here, per disk index (after their rows; .bss, read by the agent). */
__u64 rq_table_counts[RQ_TABLE_DISKS];

/*
 * Counts request `rq`'s stages (its state as it stands): 1 when counted (it
 * then sends no record), 0 when it must send its record. All or nothing: every
 * step is checked before the first count. Global: verified once, on its own.
 */
__noinline int rq_tabled_g(__u64 rq)
{
	__u64 key = rq, ns[RQ_PLAN_STEPS];
	struct rq_state *st = rq_find(&key);
	__u16 slot[RQ_PLAN_STEPS];
	__u8 row[RQ_PLAN_STEPS];
	struct rq_table_disks *d;
	__u32 zero = 0, mask = 0, disk, pk, n;
	struct rq_plan *p;
	int i;

	if (!st)
		return 0;
	d = bpf_map_lookup_elem(&rq_table_devs, &zero);
	if (!d)
		return 0;
	for (disk = 0; disk < RQ_TABLE_DISKS; disk++) {
		if (d->dev[disk] == st->ev.dev)
			break;
	}
	if (disk >= RQ_TABLE_DISKS || !st->ev.dev)
		return 0;
	for (i = 0; i < P_NR; i++) {
		if (st->ev.ts[i])
			mask |= 1U << i;
	}
	pk = disk << P_NR | mask;
	p = bpf_map_lookup_elem(&rq_plans, &pk);
	if (!p)
		return 0;
	n = p->n;
	if (!n || n > RQ_PLAN_STEPS)
		return 0;
	for (i = 0; i < RQ_PLAN_STEPS; i++) {
		__u8 a, b, r;
		__u64 ta, tb, v;
		__u32 s;

		if (i >= n)
			break;
		a = p->from[i];
		b = p->to[i];
		r = p->row[i];
		if (a >= P_NR || b >= P_NR || !r || r > RQ_TABLE_ROWS)
			return 0;
		ta = st->ev.ts[a];
		tb = st->ev.ts[b];
		/* a negative stage counts as 0, in the slot of 1 (as the agent's) */
		v = tb > ta ? tb - ta : 0;
		s = hist_slot(v ? v : 1);
		if (s >= RQ_ROW_SLOTS)
			return 0;
		ns[i] = v;
		slot[i] = s;
		row[i] = r - 1;
	}
	for (i = 0; i < RQ_PLAN_STEPS; i++) {
		struct rq_row *w;
		__u32 r, s;

		if (i >= n)
			break;
		r = row[i];
		s = slot[i];
		w = bpf_map_lookup_elem(&rq_rows, &r);
		if (!w || s >= RQ_ROW_SLOTS)
			continue;
		__sync_fetch_and_add(&w->slots[s], 1);
		__sync_fetch_and_add(&w->sum, ns[i]);
	}
	__sync_fetch_and_add(&rq_table_counts[disk & (RQ_TABLE_DISKS - 1)], 1);
	return 1;
}

#endif /* VIOTRACE_GUEST_RQ_TABLE_H */

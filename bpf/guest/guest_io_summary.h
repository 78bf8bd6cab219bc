/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The traced syscalls (x86-64 numbers), and the latencies of those that send
 * no record: counted by the syscall's exit (guest_task.h) in the bucket layout
 * of the agent's stage histograms, which the agent reads once an interval
 * (guest-agent/src/io_hist.rs).
 */
#ifndef VIOTRACE_GUEST_IO_SUMMARY_H
#define VIOTRACE_GUEST_IO_SUMMARY_H

#define NR_read 0
#define NR_write 1
#define NR_pread64 17
#define NR_pwrite64 18
#define NR_readv 19
#define NR_writev 20
#define NR_fsync 74
#define NR_fdatasync 75
#define NR_io_submit 209
#define NR_sync_file_range 277
#define NR_preadv 295
#define NR_pwritev 296
#define NR_preadv2 327
#define NR_pwritev2 328
#define NR_io_uring_enter 426

/* floor(log2(v)) of v > 0 (BPF has no count of leading zeros): halving steps. */
static __always_inline __u32 log2_u64(__u64 v)
{
	__u32 r = 0;

#pragma unroll
	for (__u32 sh = 32; sh > 1; sh >>= 1) {
		if (v >> sh) {
			v >>= sh;
			r += sh;
		}
	}
	return r + (__u32)(v >> 1);
}

/* The slot of `ns` (1 <= ns < 2^41) in the stage histograms' layout: the
 * agent's hist_index (shared/src/stats.rs), which a unit test mirrors. */
static __always_inline __u32 hist_slot(__u64 ns)
{
	__u32 bucket = log2_u64(ns | 255) - 7;

	return ((bucket + 1) << 7) + (__u32)(ns >> bucket) - 128;
}

/*
 * io_hist's common case without a hash lookup: the slots below IO_ROW_SLOTS
 * (latencies under 2^31 ns) of the traced syscalls, as rows of plain counters
 * in .bss (row i: syscall io_row_nrs[i]; io_row_counts[i]: what row i holds),
 * which the agent reads through the skeleton's mapping. The rest goes to
 * io_hist (io_hashed counts it). Slots are 32-bit (200 KiB of .bss, which
 * libbpf's load copies once more at the agent's memory peak): the agent takes
 * differences, which wrap correctly, every interval.
 */
#define IO_ROWS 16
#define IO_ROW_SLOTS 3200
/* The rows, in order: one list for the table userspace reads and for
 * io_row_of(), which folds to a constant where the syscall is known. */
#define IO_ROW_LIST(X)									\
	X(0, NR_read) X(1, NR_write) X(2, NR_pread64) X(3, NR_pwrite64) X(4, NR_readv)	\
	X(5, NR_writev) X(6, NR_fsync) X(7, NR_fdatasync) X(8, NR_io_submit)		\
	X(9, NR_sync_file_range) X(10, NR_preadv) X(11, NR_pwritev) X(12, NR_preadv2)	\
	X(13, NR_pwritev2) X(14, NR_io_uring_enter)
#define IO_ROW_NR(row, nr) [row] = nr,
const volatile __u32 io_row_nrs[IO_ROWS] = {
	IO_ROW_LIST(IO_ROW_NR)
	[IO_ROWS - 1] = ~0U,	/* (unused) */
};
__u32 io_rows[IO_ROWS][IO_ROW_SLOTS];
__u64 io_row_counts[IO_ROWS];
__u64 io_hashed;

/* The row of syscall `nr`, or IO_ROWS. */
static __always_inline __u32 io_row_of(__u32 nr)
{
#define IO_ROW_CASE(row, n) case n: return row;
	switch (nr) {
	IO_ROW_LIST(IO_ROW_CASE)
	}
	return IO_ROWS;
#undef IO_ROW_CASE
}

/*
 * A syscall faster than io_detail_ns is counted in io_rows or io_hist, and
 * io_sum, and sends no record; false: it sends its record (slow, io_hist
 * full, or not measurable).
 */
static __always_inline bool sys_summarized(__u32 nr, __u64 enter, __u64 exit)
{
	__u64 ns = exit - enter, one = 1, *c, *sum;
	__u32 key, slot, row;

	if (!enter || exit <= enter || ns >= io_detail_ns || ns >> 41 || nr >= IO_SUM_NRS)
		return false;
	sum = bpf_map_lookup_elem(&io_sum, &nr);
	if (!sum)
		return false;
	slot = hist_slot(ns);
	row = io_row_of(nr);
	if (row < IO_ROWS && slot < IO_ROW_SLOTS) {
		__sync_fetch_and_add(&io_rows[row][slot], 1);
		__sync_fetch_and_add(&io_row_counts[row], 1);
		goto counted;
	}
	key = IO_HIST_KEY(nr, slot);
	c = bpf_map_lookup_elem(&io_hist, &key);
	if (c) {
		__sync_fetch_and_add(c, 1);
	} else if (bpf_map_update_elem(&io_hist, &key, &one, BPF_NOEXIST)) {
		/* another CPU may have inserted it meanwhile */
		c = bpf_map_lookup_elem(&io_hist, &key);
		if (!c) {
			stat_inc(S_IO_HIST_FULL);
			return false;
		}
		__sync_fetch_and_add(c, 1);
	}
	__sync_fetch_and_add(&io_hashed, 1);
counted:
	__sync_fetch_and_add(sum, ns);
	stat_inc(S_IO_SUMMARIZED);
	return true;
}

#endif /* VIOTRACE_GUEST_IO_SUMMARY_H */

/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The entry of a read, write, pread64 or pwrite64 by a thread without a
 * syscall state (one that never did traced file I/O: a server's socket and
 * pipe threads), kept until its file is known. With the vfs_read/vfs_write
 * programs attached (rw_file_hooked) the entry no longer resolves such a
 * thread's fd (the fd table, the file and its inode: three probe reads, about
 * 750 instructions per syscall under the lab's guest, for what is usually a
 * socket): it notes its time and arguments here, and vfs_read or vfs_write,
 * which have the file typed, make the thread's state from them only for a
 * file or disk (guest_rw_file.h). The syscall's exit drops a note vfs_* did
 * not take (a bad fd never reaches them).
 *
 * A note lives from the entry to the vfs program, microseconds: slot
 * tid % SYS_PEND_SLOTS, written over by any thread (no claim; the note's own
 * thread is the only reader). A thread whose slot holds another live note
 * takes it over and counts S_SYS_ENTRY_LOST: that other syscall is not traced
 * (if its file was a socket or pipe, it would not have been anyway).
 */
#ifndef VIOTRACE_GUEST_SYS_PEND_H
#define VIOTRACE_GUEST_SYS_PEND_H

#define SYS_PEND_SLOTS 1024
/* the owner field read and written as it stands in the source order */
#define PEND_TID(p) (*(volatile __u32 *)&(p)->tid)

struct sys_pend {
	__u32 tid;		/* 0: free (written last, cleared first) */
	__u32 nr;
	__u64 enter_ts;
	__u64 bytes;
	__u64 offset;		/* FILE_AT_ARG: the offset argument */
	__u32 how;		/* FILE_AT_POS / FILE_AT_ARG (guest_task.h) */
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, SYS_PEND_SLOTS);
	__type(key, __u32);
	__type(value, struct sys_pend);
} sys_pends SEC(".maps");

static __always_inline struct sys_pend *pend_slot(__u32 tid)
{
	__u32 i = tid & (SYS_PEND_SLOTS - 1);

	return bpf_map_lookup_elem(&sys_pends, &i);
}

/* Notes thread `tid`'s entry of syscall `nr` (now). */
static __always_inline void pend_put(__u32 tid, __u32 nr, __u32 how, __u64 bytes, __u64 offset)
{
	struct sys_pend *p = pend_slot(tid);
	__u32 was;

	if (!p || !tid)
		return;
	was = PEND_TID(p);
	if (was && was != tid)
		stat_inc(S_SYS_ENTRY_LOST);
	/* the owner field last, after a clear: a reader that sees its tid
	 * before and after copying the rest copied one note */
	PEND_TID(p) = 0;
	barrier();
	p->nr = nr;
	p->how = how;
	p->bytes = bytes;
	p->offset = offset;
	p->enter_ts = bpf_ktime_get_ns();
	barrier();
	PEND_TID(p) = tid;
}

/* Takes thread `tid`'s note into `out` and frees the slot: false when the
 * slot holds none of this thread's (none made, or taken over). */
static __always_inline bool pend_take(__u32 tid, struct sys_pend *out)
{
	struct sys_pend *p = pend_slot(tid);

	if (!p || !tid || PEND_TID(p) != tid)
		return false;
	barrier();
	*out = *p;
	barrier();
	if (PEND_TID(p) != tid)
		return false;
	PEND_TID(p) = 0;
	return true;
}

/* Drops thread `tid`'s note, if its slot still holds one. */
static __always_inline void pend_drop(__u32 tid)
{
	struct sys_pend *p = pend_slot(tid);

	if (p && tid && PEND_TID(p) == tid)
		PEND_TID(p) = 0;
}

#endif /* VIOTRACE_GUEST_SYS_PEND_H */

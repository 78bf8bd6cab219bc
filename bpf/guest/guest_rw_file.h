/* SPDX-License-Identifier: GPL-2.0 */
/*
 * fentry mode: the file of a read, write, pread64 or pwrite64, taken typed
 * where the syscall reaches vfs_read or vfs_write (guest_task.h leaves it
 * here once both programs are attached: rw_file_hooked).
 */
#ifndef VIOTRACE_GUEST_RW_FILE_H
#define VIOTRACE_GUEST_RW_FILE_H

/*
 * The syscall of thread `tid`, which has no state, reached vfs_read or
 * vfs_write with file `f` (typed): its entry's note (guest_sys_pend.h) makes
 * the thread's state, only for a file or disk. A socket, pipe or tty: nothing
 * (no state, no record, as when the entry resolved the fd).
 */
static __always_inline void rw_file_first(struct file *f, __u32 tid)
{
	struct sys_info fi = {};
	struct sys_pend n;

	if (!pend_take(tid, &n) || !file_info_typed(&fi, f, n.how == FILE_AT_POS))
		return;
	fi.bytes = n.bytes;
	if (n.how != FILE_AT_POS) {
		fi.offset = n.offset;
		fi.has_offset = 1;
	}
	sys_begin(tid, NULL, n.nr, &fi, 0, n.enter_ts);
}

/*
 * The file of a read, write, pread64 or pwrite64 whose entry left it here
 * (file_pending, or a note for a thread without a state): vfs_read and
 * vfs_write take it typed, so the file, its inode and its position are plain
 * loads where the entry's fd walk makes three probe reads. Not a file or disk
 * (socket, pipe, tty): the syscall sends no record, as when the entry resolved
 * the fd.
 */
static __always_inline void rw_file(struct file *f)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct sys_state *s = sys_get(&tid);
	bool ok;

	if (!s) {
		rw_file_first(f, tid);
		return;
	}
	if (!s->file_pending)
		return;
	/* the entry set `cur` (pread64/pwrite64: its offset argument) */
	ok = file_info_typed(&s->cur, f, s->file_pending == FILE_AT_POS);
	s->file_pending = 0;
	if (!ok) {
		s->enter_ts = 0;
		return;
	}
	s->inode = s->cur.inode;
	s->direct = s->cur.direct;
	s->offset = s->cur.offset;
	s->has_offset = s->cur.has_offset;
	/* who dirtied the page cache of this inode (for write-back) */
	if (is_write_nr(s->nr) && !s->direct)
		bpf_map_update_elem(&inode_writer, &s->inode, &s->id, BPF_ANY);
}

/* vfs_read(file, buf, count, pos), vfs_write(file, buf, count, pos) */
SEC("?fentry/vfs_read")
int BPF_PROG(fe_vfs_read, struct file *file)
{
	rw_file(file);
	return 0;
}

SEC("?fentry/vfs_write")
int BPF_PROG(fe_vfs_write, struct file *file)
{
	rw_file(file);
	return 0;
}

#endif /* VIOTRACE_GUEST_RW_FILE_H */

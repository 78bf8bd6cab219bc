/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Task side: entry and exit of the I/O syscalls (guest_io_summary.h), through the
 * raw syscall tracepoints, which every mode can use, or per-syscall fentry and
 * fexit programs. The file (inode, offset, direct or buffered) is resolved
 * from the fd at entry, or for read/write typed at vfs_read/vfs_write
 * (guest_rw_file.h).
 */
#ifndef VIOTRACE_GUEST_TASK_H
#define VIOTRACE_GUEST_TASK_H

#define VT_O_DIRECT 040000
#define VT_S_IFMT 00170000
#define VT_S_IFREG 0100000
#define VT_S_IFBLK 0060000
#define AIO_BATCH 16

_Static_assert(__builtin_offsetof(struct fdtable, fd) == 8, "fdtable starts with max_fds, fd");

/* The open file behind fd of the current task, or NULL. */
static __always_inline struct file *fd_file(int fd)
{
	struct fdtable *fdt;
	/* struct fdtable { unsigned int max_fds; struct file **fd; …}: both in one read */
	struct {
		unsigned int max_fds;
		struct file **fd;
	} head = {};
	struct file *f = NULL;

	if (fd < 0)
		return NULL;
	if (bpf_core_enum_value_exists(enum bpf_func_id, BPF_FUNC_get_current_task_btf)) {
		/* 5.11+: a typed task, whose files and fd table are plain loads */
		struct task_struct *t = bpf_get_current_task_btf();
		struct files_struct *files = t->files;

		if (!files)
			return NULL;
		fdt = files->fdt;
		if (!fdt)
			return NULL;
		head.max_fds = fdt->max_fds;
		head.fd = fdt->fd;
	} else {
		struct task_struct *t = (struct task_struct *)bpf_get_current_task();

		fdt = BPF_CORE_READ(t, files, fdt);
		if (!fdt || bpf_probe_read_kernel(&head, sizeof(head), fdt))
			return NULL;
	}
	if ((unsigned int)fd >= head.max_fds || !head.fd)
		return NULL;
	bpf_probe_read_kernel(&f, sizeof(f), &head.fd[fd]);
	return f;
}

/* An inode's type (i_mode & S_IFMT, 0 if unreadable) and number: one window read. */
static __always_inline __u16 inode_kind(struct inode *ino, __u64 *nr)
{
	__u32 o_mode = bpf_core_field_offset(struct inode, i_mode);
	__u32 o_ino = bpf_core_field_offset(struct inode, i_ino);
	__u32 lo = WIN_MIN(o_mode, o_ino);
	__u32 hi = WIN_MAXOF(o_mode + 2, o_ino + 8);
	__u8 w[WIN_MAX];
	__u16 mode;

	if (WIN_FITS(w, lo, hi)) {
		if (WIN_READ(w, ino, lo, hi))
			return 0;
		mode = WIN_GET(w, __u16, o_mode, lo);
		*nr = WIN_GET(w, __u64, o_ino, lo);
	} else {
		mode = BPF_CORE_READ(ino, i_mode);
		*nr = BPF_CORE_READ(ino, i_ino);
	}
	return mode & VT_S_IFMT;
}

/* Fills inode/offset/direct from an open file; false when it is not a file or disk. */
static __always_inline bool file_info(struct sys_info *s, struct file *f, bool use_pos)
{
	/* struct file: f_inode, f_flags, f_pos; struct inode: i_mode … i_ino (windows) */
	__u32 fo_ino = bpf_core_field_offset(struct file, f_inode);
	__u32 fo_flags = bpf_core_field_offset(struct file, f_flags);
	__u32 fo_pos = bpf_core_field_offset(struct file, f_pos);
	__u32 flo = WIN_MIN(fo_ino, WIN_MIN(fo_flags, fo_pos));
	__u32 fhi = WIN_MAXOF(fo_ino + 8, WIN_MAXOF(fo_flags + 4, fo_pos + 8));
	__u8 w[WIN_MAX];
	struct inode *ino;
	__u64 ino_nr;
	__u32 flags;
	__u64 pos;
	__u16 mode;

	if (!f)
		return false;
	if (WIN_FITS(w, flo, fhi)) {
		if (WIN_READ(w, f, flo, fhi))
			return false;
		ino = WIN_GET(w, struct inode *, fo_ino, flo);
		flags = WIN_GET(w, __u32, fo_flags, flo);
		pos = WIN_GET(w, __u64, fo_pos, flo);
	} else {
		ino = BPF_CORE_READ(f, f_inode);
		flags = BPF_CORE_READ(f, f_flags);
		pos = BPF_CORE_READ(f, f_pos);
	}
	if (!ino)
		return false;
	mode = inode_kind(ino, &ino_nr);
	if (mode != VT_S_IFREG && mode != VT_S_IFBLK)
		return false;
	s->inode = ino_nr;
	s->direct = (flags & VT_O_DIRECT) != 0;
	if (use_pos) {
		s->offset = pos;
		s->has_offset = 1;
	}
	return true;
}

/* The same from a typed file (fentry, tp_btf): plain loads. */
static __always_inline bool file_info_typed(struct sys_info *s, struct file *f, bool use_pos)
{
	struct inode *ino;
	__u16 mode;

	if (!f)
		return false;
	ino = f->f_inode;
	if (!ino)
		return false;
	mode = ino->i_mode & VT_S_IFMT;
	if (mode != VT_S_IFREG && mode != VT_S_IFBLK)
		return false;
	s->inode = ino->i_ino;
	s->direct = (f->f_flags & VT_O_DIRECT) != 0;
	if (use_pos) {
		s->offset = f->f_pos;
		s->has_offset = 1;
	}
	return true;
}

/* The same from an fd of the current task. */
static __always_inline bool sys_file(struct sys_info *s, int fd, bool use_pos)
{
	return file_info(s, fd_file(fd), use_pos);
}

#define IOV_MAX_SUM 16

/* Bytes requested by a user iovec array (the first IOV_MAX_SUM entries). */
static __always_inline __u64 iov_bytes(const struct iovec *uiov, long cnt)
{
	__u64 sum = 0;

	for (int i = 0; i < IOV_MAX_SUM; i++) {
		struct iovec v = {};

		if (i >= cnt || bpf_probe_read_user(&v, sizeof(v), &uiov[i]))
			break;
		sum += v.iov_len;
	}
	return sum;
}

static __always_inline bool is_write_nr(__u32 nr)
{
	return nr == NR_write || nr == NR_pwrite64 || nr == NR_writev || nr == NR_pwritev ||
	       nr == NR_pwritev2;
}

/*
 * A thread's entry, reused for its next syscall: what the new one does not set
 * itself is reset here, field by field: a memset of the whole state (queued
 * bios included) is some 70 stores, each costly under emulation.
 */
static __always_inline void sys_reset(struct sys_state *s)
{
	s->off_since = 0;
	s->runq_ns = 0;
	s->blocked_ns = 0;
	s->best_wait = 0;
	s->cur_holder = 0;
	s->best_holder = 0;
	s->off_runnable = 0;
	s->cur_holder_comm[0] = 0;
	s->best_holder_comm[0] = 0;
	s->qbio_next = 0;	/* the slots' old bios are not looked at again */
}

/* A state for thread `tid`, which has none: its slot if free, claimed by an
 * atomic insert into sys_claims (two CPUs never take the same one), else an
 * entry of sys_inflight, counted in the slot's `hashed` first (a lookup that
 * sees 0 there does not look in the hash map). Not reset. */
static __always_inline struct sys_state *sys_new(__u32 tid)
{
	__u64 key = tid;
	__u32 i;
	struct sys_slot *sl = sys_slot(tid, &i);
	struct sys_state *s;

	if (!sl || !tid)
		return NULL;
	if (!sl->key && !bpf_map_update_elem(&sys_claims, &i, &key, BPF_NOEXIST)) {
		sl->key = key;
		return &sl->s;
	}
	__sync_fetch_and_add(&sl->hashed, 1);
	s = map_insert(&sys_inflight, &tid, &zero_sys, S_FULL_SYS);
	if (s)
		stat_inc(S_SYS_HASHED);
	else
		__sync_fetch_and_add(&sl->hashed, -1);
	return s;
}

/*
 * A thread exits: its syscall state goes. Its slot serves the next thread
 * that maps there (until 2026-12-07 a slot was held for good, and in a
 * machine up for long nearly every new thread's state ended up in the hash
 * map). The claim goes before the key, so a thread that sees the slot free
 * can claim it. A state in sys_inflight is deleted, and uncounted.
 */
SEC("raw_tp/sched_process_exit")
int sys_thread_exit(void *ctx)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	__u32 i;
	struct sys_slot *sl = sys_slot(tid, &i);

	if (!sl || !tid)
		return 0;
	if (sl->key == tid) {
		bpf_map_delete_elem(&sys_claims, &i);
		*(volatile __u64 *)&sl->key = 0;
	} else if (sl->hashed && !bpf_map_delete_elem(&sys_inflight, &tid)) {
		__sync_fetch_and_add(&sl->hashed, -1);
	}
	pend_drop(tid);
	return 0;
}

/* Whether `nr` is one of the traced I/O syscalls. */
static __always_inline bool io_syscall(__u32 nr)
{
	switch (nr) {
	case NR_read: case NR_write: case NR_pread64: case NR_pwrite64: case NR_readv:
	case NR_writev: case NR_fsync: case NR_fdatasync: case NR_io_submit:
	case NR_sync_file_range: case NR_preadv: case NR_pwritev: case NR_preadv2:
	case NR_pwritev2: case NR_io_uring_enter:
		return true;
	}
	return false;
}

/* The pid/tid filters and the agent itself (the cheapest checks, first). */
static __always_inline bool sys_task_ok(__u64 pt)
{
	__u32 pid = pt >> 32, tid = (__u32)pt;

	return pid != self_pid && (!filter_pid || pid == filter_pid) &&
	       (!filter_tid || tid == filter_tid);
}

/* How a read/write's file comes later, at vfs_read/vfs_write (rw_file). */
#define FILE_AT_POS 1	/* read, write: at the file's position */
#define FILE_AT_ARG 2	/* pread64, pwrite64: at the offset argument */

/*
 * Thread `tid` starts syscall `nr`, entered at `enter_ts` (0: now), with what
 * is known of its file (`fi`) and where the rest comes from (`pending`): its
 * state from its last syscall (`s`, or looked up), reset, or a new one. Not
 * for a task the comm filter leaves out.
 */
static __always_inline void sys_begin(__u32 tid, struct sys_state *s, __u32 nr,
				      const struct sys_info *fi, __u8 pending, __u64 enter_ts)
{
	struct ident who;

	current_ident(&who);
	if (!comm_ok(who.comm))
		return;
	/* the thread's entry from its last syscall, or a new one (a slot may
	 * hold an exited thread's), reset */
	if (!s)
		s = sys_find(&tid);
	if (!s)
		s = sys_new(tid);
	if (!s)
		return;
	sys_reset(s);
	s->id = who;
	s->enter_ts = enter_ts ? enter_ts : bpf_ktime_get_ns();
	s->nr = nr;
	s->inode = fi->inode;
	s->offset = fi->offset;
	s->has_offset = fi->has_offset;
	s->bytes = fi->bytes;
	s->direct = fi->direct;
	s->dio_queued = 0;
	s->cur = *fi;
	s->nrefs = 0;
	s->refs_dropped = 0;
	s->file_pending = pending;

	/* Remember who dirtied the page cache of this inode (for write-back). */
	if (is_write_nr(nr) && !fi->direct && fi->inode)
		bpf_map_update_elem(&inode_writer, &fi->inode, &who, BPF_ANY);
}

/*
 * Entry of I/O syscall `nr` with its first four arguments: the file, offset
 * and size it names, and the thread's state for what follows. Inlined into
 * each per-syscall fentry program with a constant `nr`, so each keeps only
 * its own case.
 *
 * read, write, pread64 and pwrite64 leave the file to rw_file once its
 * programs are attached (rw_file_hooked, guest_rw_file.h): a thread that has a
 * state marks it file_pending; one without only notes its entry
 * (guest_sys_pend.h), since the entry cannot tell a file from a socket or pipe
 * then, and a thread that never did file I/O should not take a state for one.
 */
static __always_inline void sys_enter_args(__u32 tid, __u32 nr, long a0, long a1, long a2,
					   long a3)
{
	struct sys_state *s = NULL;
	struct sys_info tmp_hdr = {};
	__u8 pending = 0;
	bool ok = false;

	switch (nr) {
	case NR_read: case NR_write:
		if (rw_file_hooked) {
			if (!(s = sys_find(&tid))) {
				pend_put(tid, nr, FILE_AT_POS, a2, 0);
				return;
			}
			ok = true;
			pending = FILE_AT_POS;
		} else {
			ok = sys_file(&tmp_hdr, a0, true);
		}
		tmp_hdr.bytes = a2;
		break;
	case NR_readv: case NR_writev:
		ok = sys_file(&tmp_hdr, a0, true);
		if (ok)
			tmp_hdr.bytes = iov_bytes((const struct iovec *)a1, a2);
		break;
	case NR_pread64: case NR_pwrite64:
		if (rw_file_hooked) {
			if (!(s = sys_find(&tid))) {
				pend_put(tid, nr, FILE_AT_ARG, a2, a3);
				return;
			}
			ok = true;
			pending = FILE_AT_ARG;
		} else {
			ok = sys_file(&tmp_hdr, a0, false);
		}
		tmp_hdr.bytes = a2;
		tmp_hdr.offset = a3;
		tmp_hdr.has_offset = 1;
		break;
	case NR_preadv: case NR_pwritev: case NR_preadv2: case NR_pwritev2:
		ok = sys_file(&tmp_hdr, a0, a3 == -1);
		if (ok)
			tmp_hdr.bytes = iov_bytes((const struct iovec *)a1, a2);
		/* offset -1 on preadv2/pwritev2 means "current position" */
		if (a3 != -1) {
			tmp_hdr.offset = a3;
			tmp_hdr.has_offset = 1;
		}
		break;
	case NR_fsync: case NR_fdatasync:
		ok = sys_file(&tmp_hdr, a0, false);
		break;
	case NR_sync_file_range:
		ok = sys_file(&tmp_hdr, a0, false);
		tmp_hdr.offset = a1;
		tmp_hdr.has_offset = 1;
		tmp_hdr.bytes = a2;
		break;
	case NR_io_submit: {
		/* io_submit(ctx, nr, iocbpp): describe the first iocb's file, sum the sizes. */
		struct iocb **uv = (struct iocb **)a2;
		long n = a1;

		if (n <= 0)
			return;
		ok = true;
		/* aio_prep_rw hooked: it sees each iocb anyway, and does this there */
		if (aio_iocb_hooked)
			break;
		for (int i = 0; i < AIO_BATCH; i++) {
			struct iocb *up = NULL;
			struct iocb cb = {};

			if (i >= n)
				break;
			if (bpf_probe_read_user(&up, sizeof(up), &uv[i]) ||
			    bpf_probe_read_user(&cb, sizeof(cb), up))
				break;
			tmp_hdr.bytes += cb.aio_nbytes;
			if (i == 0) {
				sys_file(&tmp_hdr, cb.aio_fildes, false);
				tmp_hdr.offset = cb.aio_offset;
				tmp_hdr.has_offset = 1;
			}
		}
		break;
	}
	case NR_io_uring_enter:
		/* io_uring_enter(fd, to_submit, ...): only submissions are I/O. */
		ok = a1 > 0;
		break;
	}
	if (ok)
		sys_begin(tid, s, nr, &tmp_hdr, pending, 0);
}

/*
 * Raw syscall tracepoints: every syscall of every task runs these (and takes
 * the kernel's slower syscall path while they are attached). Used in the
 * kprobe and tracepoint modes, and in fentry mode when the per-syscall
 * programs below cannot run.
 */
SEC("raw_tp/sys_enter")
int BPF_PROG(sys_enter, struct pt_regs *regs, long id)
{
	__u32 nr = id;
	/*
	 * x86-64 syscall arguments di, si, dx, r10: one read of the pt_regs
	 * words r10 … di (r10 r9 r8 ax cx dx si di, the ptrace ABI order)
	 * instead of one read per argument.
	 */
	__u64 w[8] = {};
	__u64 pt = bpf_get_current_pid_tgid();

	/* Cheap filters first. */
	if (!sys_task_ok(pt) || !io_syscall(nr))
		return 0;
	if (filter_cgroup && bpf_get_current_cgroup_id() != filter_cgroup)
		return 0;
	if (bpf_probe_read_kernel(w, sizeof(w), (void *)regs + bpf_core_field_offset(struct pt_regs, r10)))
		return 0;
	sys_enter_args((__u32)pt, nr, w[7], w[6], w[5], w[0]);
	return 0;
}

/*
 * A submission syscall moves on to its next request (io_uring SQE, aio iocb):
 * the bios queued from now on belong to that file and offset. The record keeps
 * the first request's file.
 */
static __always_inline void sys_next_file(struct sys_state *s, const struct sys_info *fi)
{
	s->cur = *fi;
	s->dio_queued = 0;
	if (!s->inode) {
		s->inode = fi->inode;
		s->offset = fi->offset;
		s->has_offset = fi->has_offset;
		s->direct = fi->direct;
	}
}

/*
 * io_submit: each read/write iocb in turn, at aio_prep_rw(kiocb, iocb), which
 * runs once the iocb's file is open (req->ki_filp), with the kernel's copy of
 * the iocb. The bios queued from then on are that iocb's. An fsync iocb does
 * not come here: its flush keeps the file of the iocb before it.
 */
static __always_inline struct sys_state *aio_sys(void)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct sys_state *s = sys_get(&tid);

	return s && s->nr == NR_io_submit ? s : NULL;
}

static __always_inline void aio_next(struct sys_state *s, struct sys_info *fi, __u64 offset)
{
	fi->offset = offset;
	fi->has_offset = 1;
	sys_next_file(s, fi);
}

/* fentry: typed arguments, so the file, its inode and the iocb are plain loads
 * (no user copy of the iocb, no walk of the fd table, no probe read). */
SEC("?fentry/aio_prep_rw")
int BPF_PROG(fe_aio_prep_rw, struct kiocb *req, const struct iocb *iocb)
{
	struct sys_state *s = aio_sys();
	struct sys_info fi = {};

	if (!s)
		return 0;
	s->bytes += iocb->aio_nbytes;
	if (file_info_typed(&fi, req->ki_filp, false))
		aio_next(s, &fi, iocb->aio_offset);
	return 0;
}

SEC("?kprobe/aio_prep_rw")
int BPF_KPROBE(kp_aio_prep_rw, struct kiocb *req, const struct iocb *iocb)
{
	struct sys_state *s = aio_sys();
	struct sys_info fi = {};

	if (!s)
		return 0;
	s->bytes += BPF_CORE_READ(iocb, aio_nbytes);
	if (file_info(&fi, BPF_CORE_READ(req, ki_filp), false))
		aio_next(s, &fi, BPF_CORE_READ(iocb, aio_offset));
	return 0;
}

#define NR_ANY (~0U)

/* Exit of a traced syscall: its record, or its latency summarized. `nr`: the
 * syscall's number where the program knows it (a constant: the summary's row
 * folds), else NR_ANY (the state's). */
static __always_inline void sys_exit_ret(long ret, __u32 nr)
{
	__u64 pt = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)pt;
	struct sys_state *s;
	struct vt_io_event *e;
	__u64 now;

	if (!sys_task_ok(pt))
		return;
	s = sys_get(&tid);
	if (!s) {
		/* a read or write of a thread without a state that never reached
		 * vfs_read/vfs_write (a bad fd): its entry's note */
		if (rw_file_hooked && (nr == NR_ANY || nr == NR_read || nr == NR_write ||
				       nr == NR_pread64 || nr == NR_pwrite64))
			pend_drop(tid);
		return;
	}
	if (nr == NR_ANY) {
		nr = s->nr;
	} else if (s->nr != nr) {
		/* another syscall's entry whose exit ran before this program was
		 * attached: not this syscall's */
		stat_inc(S_SYS_EXIT_UNSEEN);
		s->enter_ts = 0;
		return;
	}
	if (s->file_pending) {
		/* never reached vfs_read/vfs_write (a bad fd: no file I/O), or
		 * its program did not run there (only a success proves that) */
		if (ret >= 0)
			stat_inc(S_SYS_FILE_UNSEEN);
		s->enter_ts = 0;
		return;
	}
	now = bpf_ktime_get_ns();
	if (io_detail_ns && sys_summarized(nr, s->enter_ts, now)) {
		s->enter_ts = 0;
		return;
	}
	e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		stat_inc(S_RB_DROP_IO);
		s->enter_ts = 0;
		return;
	}
	e->kind = K_IO;
	e->nr = nr;
	e->enter_ts = s->enter_ts;
	e->exit_ts = now;
	e->ret = ret;
	e->bytes = s->bytes;
	e->inode = s->inode;
	e->file_offset = s->offset;
	e->has_file_offset = s->has_offset;
	e->cgroup_id = s->id.cgroup_id;
	e->pid = s->id.pid;
	e->tid = s->id.tid;
	__builtin_memcpy(e->comm, s->id.comm, VT_COMM);
	e->nrefs = s->nrefs;
	e->refs_dropped = s->refs_dropped;
	/* only the listed ones (userspace reads nrefs of them) */
	for (int i = 0; i < VT_MAX_REFS; i++) {
		if (i >= s->nrefs)
			break;
		e->refs[i] = s->refs[i];
	}
	__builtin_memset(e->pad, 0, sizeof(e->pad));
	e->runq_ns = s->runq_ns;
	e->blocked_ns = s->blocked_ns;
	e->holder_pid = s->best_holder;
	e->pad2 = 0;
	__builtin_memcpy(e->holder_comm, s->best_holder_comm, VT_COMM);
	bpf_ringbuf_submit(e, rb_flags_counted(S_IO_EMITTED));
	s->enter_ts = 0;	/* between syscalls: the entry waits for the next */
}

SEC("raw_tp/sys_exit")
int BPF_PROG(sys_exit, struct pt_regs *regs, long ret)
{
	sys_exit_ret(ret, NR_ANY);
	return 0;
}

/*
 * fentry mode: an entry and an exit program per traced syscall, on its x86-64
 * wrapper (`__x64_sys_<name>(const struct pt_regs *)`). Only the I/O syscalls
 * run a program, the syscall path of every other one stays the fast one, and
 * the arguments are plain loads from the typed registers.
 */
#define SYS_PROGS(name, nr)								\
SEC("?fentry/__x64_sys_" #name)							\
int BPF_PROG(fe_sys_##name, struct pt_regs *regs)					\
{											\
	__u64 pt = bpf_get_current_pid_tgid();						\
											\
	if (!sys_task_ok(pt))								\
		return 0;								\
	if (filter_cgroup && bpf_get_current_cgroup_id() != filter_cgroup)		\
		return 0;								\
	sys_enter_args((__u32)pt, nr, regs->di, regs->si, regs->dx, regs->r10);	\
	return 0;									\
}											\
SEC("?fexit/__x64_sys_" #name)								\
int BPF_PROG(fx_sys_##name, struct pt_regs *regs, long ret)				\
{											\
	sys_exit_ret(ret, nr);								\
	return 0;									\
}

SYS_PROGS(read, NR_read)
SYS_PROGS(write, NR_write)
SYS_PROGS(pread64, NR_pread64)
SYS_PROGS(pwrite64, NR_pwrite64)
SYS_PROGS(readv, NR_readv)
SYS_PROGS(writev, NR_writev)
SYS_PROGS(fsync, NR_fsync)
SYS_PROGS(fdatasync, NR_fdatasync)
SYS_PROGS(io_submit, NR_io_submit)
SYS_PROGS(sync_file_range, NR_sync_file_range)
SYS_PROGS(preadv, NR_preadv)
SYS_PROGS(pwritev, NR_pwritev)
SYS_PROGS(preadv2, NR_preadv2)
SYS_PROGS(pwritev2, NR_pwritev2)
SYS_PROGS(io_uring_enter, NR_io_uring_enter)

#endif

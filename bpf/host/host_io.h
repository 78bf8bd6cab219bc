/* SPDX-License-Identifier: GPL-2.0 */
/* Host I/O of QEMU's threads (syscalls, aio, io_uring), the host block layer, process exit (included by viotrace_host.bpf.c, in this order). */
#pragma once

/* ---- host I/O: syscalls of QEMU's threads ---- */

/* A host I/O of a traced QEMU starts on this thread; with assoc, the block
 * requests this thread issues until the syscall returns belong to it. */
/* Without blk_aio_* probes (QL_NO_SUBMIT) a host I/O is tracked from its
 * syscall, keyed by its first buffer; virtqueue_push finds it by the element's
 * first data buffer. A new I/O on a buffer starts its state afresh. */
static __always_inline __u64 *io_lazy(__u32 tgid, struct tg_ptr *bk)
{
	__u64 id = __sync_fetch_and_add(&next_merge_id, 1) + 1;
	struct io_state io = { .refs = 1, .buf = bk->ptr, .pad = 1 };
	struct tg_ptr ik = { .tgid = tgid, .ptr = id };
	if (bpf_map_update_elem(&ios, &ik, &io, BPF_ANY)) {
		stat_inc(ST_IOS_FULL);
		return NULL;
	}
	bpf_map_update_elem(&io_by_buf, bk, &id, BPF_ANY);
	return bpf_map_lookup_elem(&io_by_buf, bk);
}

static __always_inline int io_enter_assoc(__u64 buf, int assoc)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct qemu_layout *l = bpf_map_lookup_elem(&qemu_procs, &tgid);
	if (!l)
		return 0;
	struct tg_ptr bk = { .tgid = tgid, .ptr = buf };
	__u64 *mid = bpf_map_lookup_elem(&io_by_buf, &bk);
	if (!mid && (l->flags & QL_NO_SUBMIT))
		mid = io_lazy(tgid, &bk);
	if (!mid)
		return 0;
	struct tg_ptr ik = { .tgid = tgid, .ptr = *mid };
	struct io_state *io = bpf_map_lookup_elem(&ios, &ik);
	if (!io)
		return 0;
	if (io->pad && io->ts[HP_IO_ISSUE]) {
		/* lazily tracked and already issued: a new I/O on the same buffer */
		io->ts[HP_DISK_ISSUE] = 0;
		io->ts[HP_DISK_COMPLETE] = 0;
		io->ts[HP_IO_COMPLETE] = 0;
		io->ts[HP_IO_ISSUE] = 0;
		io->disk_dev = 0;
		io->nb_inflight = 0;
		io->nb_issued = 0;
		io->nb_bytes = 0;
	}
	if (!io->ts[HP_IO_ISSUE])
		io->ts[HP_IO_ISSUE] = bpf_ktime_get_ns();
	stat_inc(ST_IO_MATCHED);
	if (!assoc)
		return 0;
	struct tid_io t = { .tgid = tgid, .merge_id = *mid };
	bpf_map_update_elem(&tid_ios, &tid, &t, BPF_ANY);
	return 0;
}

static __always_inline int io_enter(__u64 buf)
{
	return io_enter_assoc(buf, 1);
}

static __always_inline int io_exit(int complete)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)id;
	struct tid_io *t = bpf_map_lookup_elem(&tid_ios, &tid);
	if (!t)
		return 0;
	if (complete) {
		struct tg_ptr ik = { .tgid = t->tgid, .ptr = t->merge_id };
		struct io_state *io = bpf_map_lookup_elem(&ios, &ik);
		if (io && !io->ts[HP_IO_COMPLETE])
			io->ts[HP_IO_COMPLETE] = bpf_ktime_get_ns();
	}
	bpf_map_delete_elem(&tid_ios, &tid);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_pread64")
int pread_enter(struct trace_event_raw_sys_enter *ctx)
{
	return io_enter(ctx->args[1]);
}

SEC("tracepoint/syscalls/sys_enter_pwrite64")
int pwrite_enter(struct trace_event_raw_sys_enter *ctx)
{
	return io_enter(ctx->args[1]);
}

static __always_inline int iov_enter(struct trace_event_raw_sys_enter *ctx)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	if (!bpf_map_lookup_elem(&qemu_procs, &tgid))
		return 0;
	return io_enter(read_u64(ctx->args[1])); /* iov[0].iov_base */
}

SEC("tracepoint/syscalls/sys_enter_preadv")
int preadv_enter(struct trace_event_raw_sys_enter *ctx)
{
	return iov_enter(ctx);
}

SEC("tracepoint/syscalls/sys_enter_pwritev")
int pwritev_enter(struct trace_event_raw_sys_enter *ctx)
{
	return iov_enter(ctx);
}

SEC("tracepoint/syscalls/sys_enter_preadv2")
int preadv2_enter(struct trace_event_raw_sys_enter *ctx)
{
	return iov_enter(ctx);
}

SEC("tracepoint/syscalls/sys_enter_pwritev2")
int pwritev2_enter(struct trace_event_raw_sys_enter *ctx)
{
	return iov_enter(ctx);
}

SEC("tracepoint/syscalls/sys_enter_fdatasync")
int fdatasync_enter(struct trace_event_raw_sys_enter *ctx)
{
	return io_enter(0);
}

SEC("tracepoint/syscalls/sys_enter_fsync")
int fsync_enter(struct trace_event_raw_sys_enter *ctx)
{
	return io_enter(0);
}

SEC("tracepoint/syscalls/sys_exit_pread64")
int pread_exit(void *ctx)
{
	return io_exit(1);
}

SEC("tracepoint/syscalls/sys_exit_pwrite64")
int pwrite_exit(void *ctx)
{
	return io_exit(1);
}

SEC("tracepoint/syscalls/sys_exit_preadv")
int preadv_exit(void *ctx)
{
	return io_exit(1);
}

SEC("tracepoint/syscalls/sys_exit_pwritev")
int pwritev_exit(void *ctx)
{
	return io_exit(1);
}

SEC("tracepoint/syscalls/sys_exit_preadv2")
int preadv2_exit(void *ctx)
{
	return io_exit(1);
}

SEC("tracepoint/syscalls/sys_exit_pwritev2")
int pwritev2_exit(void *ctx)
{
	return io_exit(1);
}

SEC("tracepoint/syscalls/sys_exit_fdatasync")
int fdatasync_exit(void *ctx)
{
	return io_exit(1);
}

SEC("tracepoint/syscalls/sys_exit_fsync")
int fsync_exit(void *ctx)
{
	return io_exit(1);
}

/* aio=native: io_submit(ctx, nr, iocbpp); completions are reaped from the
 * user-mapped ring without a syscall, so h.io_complete is not seen. */
struct iocbs_ctx {
	__u64 iocbpp;
	__u32 nr;
	__u32 assoc;
};

static long iocb_one(__u64 i, void *data)
{
	struct iocbs_ctx *c = data;
	if (i >= c->nr)
		return 1;
	__u64 iocb = read_u64(c->iocbpp + i * 8);
	if (!iocb)
		return 0;
	__u16 opcode = 0;
	bpf_probe_read_user(&opcode, sizeof(opcode), (void *)(iocb + 16)); /* aio_lio_opcode */
	__u64 buf = read_u64(iocb + 24);                                   /* aio_buf */
	if (opcode == 7 || opcode == 8) /* IOCB_CMD_PREADV/PWRITEV: buf is the iovec array */
		buf = read_u64(buf);
	else if (opcode == 2 || opcode == 3) /* FSYNC/FDSYNC */
		buf = 0;
	io_enter_assoc(buf, c->assoc);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_io_submit")
int io_submit_enter(struct trace_event_raw_sys_enter *ctx)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	if (!bpf_map_lookup_elem(&qemu_procs, &tgid))
		return 0;
	__s64 nr = ctx->args[1];
	if (nr <= 0)
		return 0;
	/* The block requests of a batch cannot be told apart: only a single iocb's
	 * are attributed (h.disk_*); every iocb gets its h.io_issue. */
	struct iocbs_ctx c = {
		.iocbpp = ctx->args[2],
		.nr = nr > MAX_IOCBS ? MAX_IOCBS : (__u32)nr,
		.assoc = nr == 1,
	};
	bpf_loop(MAX_IOCBS, iocb_one, &c, 0);
	return 0;
}

SEC("tracepoint/syscalls/sys_exit_io_submit")
int io_submit_exit(void *ctx)
{
	return io_exit(0);
}

/* aio=io_uring: user_data is QEMU's LuringAIOCB, which holds a copy of the SQE. */
SEC("tracepoint/io_uring/io_uring_submit_req")
int uring_submit(struct trace_event_raw_io_uring_submit_req *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct qemu_layout *l = bpf_map_lookup_elem(&qemu_procs, &tgid);
	if (!l || !(l->flags & QL_HAVE_LURING))
		return 0;
	__u64 ud = ctx->user_data;
	__u8 opcode = ctx->opcode;
	__u64 buf;
	if (opcode == 1 || opcode == 2) /* IORING_OP_READV/WRITEV: sqe.addr = iovec array */
		buf = read_u64(read_u64(ud + l->luring_sqe + 16));
	else if (opcode == 3) /* IORING_OP_FSYNC */
		buf = 0;
	else
		return 0;
	io_enter(buf);
	struct tid_io *t = bpf_map_lookup_elem(&tid_ios, &tid);
	if (t)
		bpf_map_update_elem(&uring_ios, &ud, t, BPF_ANY);
	return 0;
}

SEC("tracepoint/syscalls/sys_exit_io_uring_enter")
int uring_enter_exit(void *ctx)
{
	return io_exit(0);
}

SEC("tracepoint/io_uring/io_uring_complete")
int uring_complete(struct trace_event_raw_io_uring_complete *ctx)
{
	__u64 ud = ctx->user_data;
	struct tid_io *t = bpf_map_lookup_elem(&uring_ios, &ud);
	if (!t)
		return 0;
	struct tg_ptr ik = { .tgid = t->tgid, .ptr = t->merge_id };
	struct io_state *io = bpf_map_lookup_elem(&ios, &ik);
	if (io && !io->ts[HP_IO_COMPLETE])
		io->ts[HP_IO_COMPLETE] = bpf_ktime_get_ns();
	bpf_map_delete_elem(&uring_ios, &ud);
	return 0;
}

/* ---- host block layer ---- */

SEC("tp_btf/block_rq_issue")
int BPF_PROG(disk_issue, struct request *rq)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct tid_io *t = bpf_map_lookup_elem(&tid_ios, &tid);
	__u64 k = (__u64)rq;
	struct rq_origin *origin = bpf_map_lookup_elem(&rq_origins, &k);
	struct tid_io from_origin = {};
	if (!t && origin && origin->qemu) {
		/* issued later from another context (kblockd, a completion) */
		from_origin.tgid = origin->qemu;
		from_origin.merge_id = origin->merge_id;
		t = &from_origin;
	}
	__u32 dev = dev_issue(rq, t ? t->tgid : 0, origin);
	if (!t)
		return 0;
	struct tg_ptr ik = { .tgid = t->tgid, .ptr = t->merge_id };
	struct io_state *io = bpf_map_lookup_elem(&ios, &ik);
	if (!io)
		return 0;
	if (!io->ts[HP_DISK_ISSUE]) {
		io->ts[HP_DISK_ISSUE] = bpf_ktime_get_ns();
		nb_snapshot(io, dev, t->tgid); /* unless its start took it */
	}
	bpf_map_update_elem(&rq_ios, &k, t, BPF_ANY);
	stat_inc(ST_DISK_MATCHED);
	return 0;
}

SEC("tp_btf/block_rq_complete")
int BPF_PROG(disk_complete, struct request *rq, blk_status_t error, unsigned int nr_bytes)
{
	__u64 k = (__u64)rq;
	dev_complete(rq);
	struct tid_io *t = bpf_map_lookup_elem(&rq_ios, &k);
	if (!t)
		return 0;
	struct tg_ptr ik = { .tgid = t->tgid, .ptr = t->merge_id };
	struct io_state *io = bpf_map_lookup_elem(&ios, &ik);
	if (io) {
		io->ts[HP_DISK_COMPLETE] = bpf_ktime_get_ns(); /* the last one */
		struct others o = dev_others(io->disk_dev, t->tgid);
		__u64 n = o.issued > io->nb_base ? o.issued - io->nb_base : 0;
		io->nb_issued = n > 0xffffffff ? 0xffffffff : (__u32)n;
		io->nb_bytes = o.bytes > io->nb_bytes_base ? o.bytes - io->nb_bytes_base : 0;
	}
	bpf_map_delete_elem(&rq_ios, &k);
	return 0;
}

/* ---- process exec: a new QEMU for the agent's discovery ---- */

/* The file a process now runs is a QEMU system emulator when its name (as
 * /proc/PID/exe has it: links resolved) is qemu-system-* or qemu-kvm. */
static __always_inline bool is_qemu_file(const char *n)
{
	const char sys[] = "qemu-system-";
	const char kvm[] = "qemu-kvm";
	bool is_sys = true, is_kvm = n[sizeof(kvm) - 1] == 0;
	for (int i = 0; i < (int)sizeof(sys) - 1; i++)
		is_sys = is_sys && n[i] == sys[i];
	for (int i = 0; i < (int)sizeof(kvm) - 1; i++)
		is_kvm = is_kvm && n[i] == kvm[i];
	return is_sys || is_kvm;
}

/* Counts the execs of QEMU binaries: the agent scans /proc for new VMs only
 * when the count moved (it read every process's exe link once a second). */
SEC("tp_btf/sched_process_exec")
int BPF_PROG(proc_exec, struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm)
{
	char name[16] = {};
	const unsigned char *s = BPF_CORE_READ(bprm, file, f_path.dentry, d_name.name);
	/* An unreadable name counts too: the agent looks rather than misses one. */
	if (bpf_probe_read_kernel_str(name, sizeof(name), s) < 0 || is_qemu_file(name))
		stat_inc(ST_QEMU_EXECS);
	return 0;
}

/* ---- process exit: stop tracing it; userspace sweeps the maps ---- */

SEC("tracepoint/sched/sched_process_exit")
int proc_exit(void *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	bpf_map_delete_elem(&pop_arg, &tid);
	bpf_map_delete_elem(&tid_ios, &tid);
	bpf_map_delete_elem(&runnable, &tid);
	if (tgid != tid)
		return 0;
	/* The layout entry stays until the agent lets the process go (it notices the
	 * exit within a second): its counters still feed the agent's last checks. */
	if (bpf_map_lookup_elem(&qemu_procs, &tgid))
		stat_inc(ST_PROC_EXIT);
	return 0;
}

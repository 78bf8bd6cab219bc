/* SPDX-License-Identifier: GPL-2.0 */
/*
 * io_uring: each submitted read/write request names its file and offset; the
 * bios it queues inline follow, so the in-flight io_uring_enter takes them.
 * Optional: the tracepoint's name and arguments changed across kernels
 * (guest_core_fixes.h); userspace enables the one this kernel has. In fentry
 * mode on 6.0+ a typed twin (tp_btf) reads the request with plain loads.
 */
#ifndef VIOTRACE_GUEST_URING_H
#define VIOTRACE_GUEST_URING_H

#define IORING_READV 1
#define IORING_WRITEV 2
#define IORING_READ_FIXED 4
#define IORING_WRITE_FIXED 5
#define IORING_READ 22
#define IORING_WRITE 23

static __always_inline bool uring_rw_op(__u8 op)
{
	return op == IORING_READV || op == IORING_WRITEV || op == IORING_READ_FIXED ||
	       op == IORING_WRITE_FIXED || op == IORING_READ || op == IORING_WRITE;
}

/* The submitting io_uring_enter's state, or NULL. */
static __always_inline struct sys_state *uring_sys(void)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct sys_state *s = sys_get(&tid);

	return s && s->nr == NR_io_uring_enter ? s : NULL;
}

/*
 * Request `op`'s file `fi` (found) and, from its command data `cmd` (struct
 * io_rw { struct kiocb kiocb; u64 addr; u32 (5.10: u64) len; }), its position
 * and length, in one read: the syscall's current file from now on.
 */
static __always_inline void uring_next_file(struct sys_state *s, struct sys_info *fi, void *cmd,
					    __u8 op)
{
	__u32 o_pos = bpf_core_field_offset(struct kiocb, ki_pos);
	__u32 o_len = bpf_core_type_size(struct kiocb) + 8;
	__u8 w[WIN_MAX];
	__u64 pos = 0;
	__u32 len = 0;

	if (WIN_FITS(w, o_pos, o_len + 4) && o_pos < o_len) {
		if (!WIN_READ(w, cmd, o_pos, o_len + 4)) {
			pos = WIN_GET(w, __u64, o_pos, o_pos);
			len = WIN_GET(w, __u32, o_len, o_pos);
		}
	} else {
		bpf_core_read(&pos, sizeof(pos), cmd + o_pos);
		bpf_core_read(&len, sizeof(len), cmd + o_len);
	}
	fi->offset = pos;
	fi->has_offset = 1;
	sys_next_file(s, fi);
	if (op == IORING_READ || op == IORING_WRITE || op == IORING_READ_FIXED ||
	    op == IORING_WRITE_FIXED)
		s->bytes += len;
}

static __always_inline void uring_req(struct io_kiocb *req)
{
	struct sys_state *s = uring_sys();
	struct io_kiocb___new *rn = (void *)req;
	struct io_kiocb___old *ro = (void *)req;
	struct sys_info fi = {};
	__u8 op, f0 = 0;
	void *cmd;
	bool ok;

	if (!s)
		return;
	op = BPF_CORE_READ(req, opcode);
	if (!uring_rw_op(op))
		return;
	cmd = uring_cmd(req);
	if (!cmd)
		return;
	if (bpf_core_field_exists(rn->cqe)) {
		/* 5.19+: the file is looked up at issue, after this tracepoint */
		/* IOSQE_FIXED_FILE (bit 0): fd indexes the registered files */
		bpf_core_read(&f0, 1, (void *)req + bpf_core_field_offset(struct io_kiocb, flags));
		if (f0 & 1)
			return;
		ok = sys_file(&fi, BPF_CORE_READ(rn, cqe.fd), false);
	} else {
		/* 5.10/5.15: resolved before the tracepoint (fixed files too) */
		ok = file_info(&fi, BPF_CORE_READ(ro, file), false);
	}
	if (ok)
		uring_next_file(s, &fi, cmd, op);
}

/* 6.2+: io_uring_submit_req(req) */
SEC("?raw_tp/io_uring_submit_req")
int uring_submit(unsigned long long *ctx)
{
	uring_req(CTX_ARG(ctx, 0));
	return 0;
}

/* 5.10 (Debian), 5.15: io_uring_submit_sqe(ctx, req, ...); 5.19-6.1: (req, force_nonblock) */
SEC("?raw_tp/io_uring_submit_sqe")
int uring_submit_sqe(unsigned long long *ctx)
{
	uring_req(TP_ARG(ctx, tp_uring_sqe_req_pos, 1));
	return 0;
}

/*
 * The same on a typed request (fentry mode, 6.0+, where the request comes
 * first): its opcode, flags and fd are plain loads where the raw programs make
 * three probe reads, and its position and length one read instead of two.
 */
static __always_inline void uring_req_typed(struct io_kiocb *req)
{
	struct sys_state *s = uring_sys();
	struct sys_info fi = {};
	__u8 op;

	if (!s)
		return;
	op = req->opcode;
	if (!uring_rw_op(op))
		return;
	/* IOSQE_FIXED_FILE (bit 0; the flags' width changed: libbpf sizes the load) */
	if (req->flags & 1)
		return;
	if (sys_file(&fi, req->cqe.fd, false))
		uring_next_file(s, &fi, (void *)req + bpf_core_field_offset(struct io_kiocb, cmd), op);
}

SEC("?tp_btf/io_uring_submit_req")
int BPF_PROG(tb_uring_submit, struct io_kiocb *req)
{
	uring_req_typed(req);
	return 0;
}

SEC("?tp_btf/io_uring_submit_sqe")
int BPF_PROG(tb_uring_submit_sqe, struct io_kiocb *req)
{
	uring_req_typed(req);
	return 0;
}

#endif /* VIOTRACE_GUEST_URING_H */

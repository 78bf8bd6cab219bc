/* SPDX-License-Identifier: GPL-2.0 */
/* A VirtIOBlockReq read once (included by viotrace_host.bpf.c, after host_common.h). */
#pragma once

/*
 * Every VirtIOBlockReq field the uprobes read (the element's head index and
 * scatter lists, the request header copy, the status pointer, mr_next, the
 * accounting start) lies in its first REQ_SPAN bytes in QEMU 6.2-10.2 (the
 * highest, acct.start_time_ns, at 0xe0). One bpf_probe_read_user of the span
 * replaces a read per field: at the push that is one read instead of about ten,
 * each a fault-safe user copy. A field outside the span, or a span that cannot
 * be read whole (the request at the very end of a mapping), is read alone.
 */
#define REQ_SPAN 256

struct req_view {
	__u8 b[REQ_SPAN];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct req_view);
} req_views SEC(".maps");

/* This CPU's view of the request at `req`, or NULL (then fields are read alone).
 * One buffer per CPU: a later req_view_read overwrites it. */
static __always_inline struct req_view *req_view_read(__u64 req)
{
	__u32 z = 0;
	struct req_view *v = bpf_map_lookup_elem(&req_views, &z);

	if (!v || bpf_probe_read_user(v->b, REQ_SPAN, (void *)req))
		return NULL;
	return v;
}

static __always_inline __u64 rv_u64(struct req_view *v, __u64 req, __u32 off)
{
	if (v && off <= REQ_SPAN - 8)
		return *(__u64 *)(v->b + off);
	return read_u64(req + off);
}

static __always_inline __u32 rv_u32(struct req_view *v, __u64 req, __u32 off)
{
	if (v && off <= REQ_SPAN - 4)
		return *(__u32 *)(v->b + off);
	return read_u32(req + off);
}

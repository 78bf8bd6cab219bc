// SPDX-License-Identifier: GPL-2.0
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

char LICENSE[] SEC("license") = "GPL";

__u64 rq_issued = 0;

SEC("tp_btf/block_rq_issue")
int BPF_PROG(on_rq_issue)
{
	__sync_fetch_and_add(&rq_issued, 1);
	return 0;
}

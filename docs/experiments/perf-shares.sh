#!/bin/sh
# Sums a guest-profile.sh run's samples by category: perf-shares.sh DIR (a lab-out copy).
# Shares are of all the guest's samples (one vCPU). Symbols past the report's first 600 lines
# are not counted (each is under ~0.01 %).
set -e
d=${1:?usage: perf-shares.sh DIR}
awk '
/^ +[0-9.]+%/ {
	p = $1; sub("%", "", p); s = $3; all += p
	if (s == "vp_notify") c["kick (vp_notify: the notify register write, a trap to QEMU)"] += p
	else if (s ~ /^bpf_prog_/) c["BPF program bodies"] += p
	else if (s ~ /^(bpf_trampoline_|__bpf_prog_enter|__bpf_prog_exit|bpf_trace_run|migrate_enable|migrate_disable)/)
		c["BPF dispatch (trampolines, raw tracepoint runs)"] += p
	else if (s ~ /^(copy_from_kernel_nofault|bpf_probe_read|percpu_array_map_lookup|bpf_ktime_get_ns|ktime_get_mono_fast_ns|bpf_get_current|bpf_ringbuf|bpf_get_smp|htab_|__htab|bpf_map_)/)
		c["BPF helpers"] += p
}
END {
	for (k in c) printf "%6.2f %%  %s\n", c[k], k
	printf "%6.2f %%  (all symbols listed)\n", all
}' "$d/perf-sym.txt" | sort -k3
awk '/^ +[0-9.]+%/ && $2 ~ /^viotrace-/ && $3 !~ /^bpf_prog_/ { p = $1; sub("%", "", p); a += p }
END { printf "%6.2f %%  the guest agent'"'"'s threads (user and kernel)\n", a }' "$d/perf-comm.txt"
sed -n 's/^IOPS/fio IOPS/p' "$d/workload.log" 2>/dev/null || true

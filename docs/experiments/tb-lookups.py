#!/usr/bin/env python3
"""Translation-block hash lookups per virtio request by guest symbol, from tb-lookups.sh's
output and the guest's /proc/kallsyms copied in the same boot (the workload writes it).

  tb-lookups.py BASE_COUNTS BASE_KALLSYMS RUN_COUNTS RUN_KALLSYMS [--top N]

prints each run's lookups per request, then the symbols whose lookups per request grew most
(BPF programs and trampolines by name, tags dropped; user space as one line).
"""
import argparse, bisect, collections, re

p = argparse.ArgumentParser()
for n in ("base", "base_syms", "run", "run_syms"):
    p.add_argument(n)
p.add_argument("--top", type=int, default=40)
a = p.parse_args()


def per_request(counts, kallsyms):
    syms = sorted((int(w[0], 16), w[2]) for w in (l.split() for l in open(kallsyms))
                  if len(w) >= 3 and w[1] in "tTwW")
    addrs = [s for s, _ in syms]
    text = open(counts).read()
    push = int(re.search(r"@push: (\d+)", text).group(1))
    by = collections.Counter()
    for m in re.finditer(r"@pc\[(-?\d+)\]: (\d+)", text):
        pc = int(m.group(1)) & (1 << 64) - 1
        if pc < 0xFFFF800000000000:
            name = "[user]"
        else:
            i = bisect.bisect_right(addrs, pc) - 1
            name = syms[i][1] if i >= 0 else "?"
            name = re.sub(r"bpf_prog_[0-9a-f]+_", "bpf_prog_", name)
            name = re.sub(r"bpf_trampoline_\d+", "bpf_trampoline", name)
        by[name] += int(m.group(2))
    return {k: v / push for k, v in by.items()}, push


base, nb = per_request(a.base, a.base_syms)
run, nr = per_request(a.run, a.run_syms)
print(f"base {sum(base.values()):.1f} lookups per request ({nb} requests), "
      f"run {sum(run.values()):.1f} ({nr} requests)")
keys = sorted(set(base) | set(run), key=lambda k: base.get(k, 0) - run.get(k, 0))
for k in keys[: a.top]:
    print(f"{base.get(k, 0):7.2f} {run.get(k, 0):7.2f} {run.get(k, 0) - base.get(k, 0):+7.2f}  {k}")

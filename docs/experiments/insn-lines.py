#!/usr/bin/env python3
"""The guest agent's user-space instructions per I/O by source line (inlined frames, innermost
first, up to three), from a `viotrace-vm run --insn-count --insn-profile` run of one-boot.sh
(INSN=1) whose agent was built with line tables:

  CARGO_TARGET_DIR=/tmp/tgt-lines CARGO_PROFILE_GUEST_DEBUG=line-tables-only \\
    CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static" \\
    cargo build --profile guest -p viotrace-guest --features static --target x86_64-unknown-linux-gnu

(line tables change the code's addresses: the run must use that very binary).

  insn-lines.py RUN_DIR JOB SET_UP AGENT_BINARY [FUNCTION_SUBSTRING]

e.g. `insn-lines.py lab-out cap-1-qd32 cap-1 /tmp/tgt-lines/.../viotrace-guest`; with a
substring, only lines inside a frame whose function name contains it.
"""
import sys, subprocess, collections
rd, job, setup, binp = sys.argv[1:5]; sub = sys.argv[5] if len(sys.argv) > 5 else None
results = [l.split()[1:] for l in open(f"{rd}/serial.log") if l.startswith("RESULT")]
names = [r[0] for r in results]; i = names.index(job); need = {2*i, 2*i+1}
marks, state, n = {}, {}, 0
for line in open(f"{rd}/insn-profile.txt"):
    if line.startswith("mark"):
        if n - 1 in need: marks[n-1] = dict(state)
        n += 1; continue
    va, c = line.split(); state[int(va, 16)] = int(c)
if n - 1 in need: marks[n-1] = dict(state)
ios = int(results[i][1].split(";")[0]) // 4
s, e = marks[2*i], marks[2*i+1]
win = {va: (c - s.get(va, 0)) / ios for va, c in e.items() if c > s.get(va, 0)}
base_va, ranges = None, []
for w in (l.split() for l in open(f"{rd}/maps-{setup}.txt")):
    if len(w) > 5 and w[5].rsplit("/", 1)[-1] == "viotrace-guest":
        lo, hi = (int(x, 16) for x in w[0].split("-"))
        base_va = lo - int(w[2], 16) if base_va is None else base_va
        ranges.append((lo, hi))
mine = {va - base_va: c for va, c in win.items() if any(lo <= va < hi for lo, hi in ranges)}
addrs = sorted(mine)
out = subprocess.run(["addr2line", "-e", binp, "-f", "-i", "-C", "-a"] + [hex(a) for a in addrs], capture_output=True, text=True).stdout.split("\n")
# parse: 0xaddr, then pairs func/file:line (inlined chain, innermost first)
per = collections.Counter(); cur = None; chain = []
def flush():
    if cur is not None and chain:
        key = " <- ".join(f"{f.split('::')[-1][:40]}@{l.rsplit('/',1)[-1]}" for f, l in chain[:3])
        if sub is None or any(sub in f for f, _ in chain): per[key] += mine[cur]
k = 0
while k < len(out):
    l = out[k]
    if l.startswith("0x"):
        flush(); cur = int(l, 16); chain = []; k += 1; continue
    if k + 1 < len(out) and l:
        chain.append((l, out[k+1])); k += 2; continue
    k += 1
flush()
for key, v in per.most_common(60): print(f"{v:8.1f} {key}")
print("total", sum(mine.values()))

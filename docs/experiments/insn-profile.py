#!/usr/bin/env python3
"""Guest instructions per I/O by symbol, from a `viotrace-vm run --insn-count --insn-profile`
run whose workload brackets fio jobs with marks and prints `RESULT <name> <read KiB>;...`
(one-boot.sh here with INSN=1). Kernel symbols (BPF programs and trampolines included) come from
the workload's copies of /proc/kallsyms (`kallsyms-<set-up>.txt`, taken while the tracer ran);
the guest agent's own user-space symbols from its maps (`maps-<set-up>.txt`) and the binary.

  insn-profile.py RUN_DIR [BASE_JOB JOB] [--agent-binary PATH] [--top N]

prints every job's instructions per I/O by region (insn.txt; no profile needed), then JOB's kernel instructions per I/O by symbol minus BASE_JOB's (e.g. none-1-qd32
def-1-qd32), and with --agent-binary the agent's user-space instructions per I/O by symbol.
"""
import argparse, bisect, collections, os, subprocess

p = argparse.ArgumentParser()
p.add_argument("run_dir"); p.add_argument("base", nargs="?"); p.add_argument("job", nargs="?")
p.add_argument("--agent-binary"); p.add_argument("--top", type=int, default=40)
a = p.parse_args()
rd = a.run_dir

results = [l.split()[1:] for l in open(f"{rd}/serial.log") if l.startswith("RESULT")]
names = [r[0] for r in results]
counts = [dict(zip(w[2::2], map(int, w[3::2])))
          for w in (l.split() for l in open(f"{rd}/insn.txt")) if w[0] == "mark"]
for i, (name, fields) in enumerate(results):
    ios = int(fields.split(";")[0]) // 4
    d = {k: (counts[2 * i + 1][k] - counts[2 * i][k]) / ios for k in counts[0]}
    print(f"{name:20} {ios:7d} I/Os  {sum(d.values()):7.0f} per I/O: " +
          " ".join(f"{k} {v:.0f}" for k, v in d.items()))
if not a.job:
    raise SystemExit(0)
print()

# Each mark lists the blocks whose count (since the start) changed since the
# previous mark (before 2026-12-06 late night: every block): the counts at a
# mark are the running state. Only the marks the two jobs need are kept.
need = {2 * names.index(j) + k for j in (a.base, a.job) for k in (0, 1)}
marks, state, lost, n_marks = {}, {}, {}, 0
def snapshot():
    if n_marks - 1 in need:
        marks[n_marks - 1] = dict(state)
for line in open(f"{rd}/insn-profile.txt"):
    if line.startswith("mark"):
        snapshot()
        lost[n_marks] = int(line.split()[3])
        n_marks += 1; continue
    va, n = line.split(); state[int(va, 16)] = int(n)
snapshot()
def window(job):
    i = names.index(job)
    ios = int(results[i][1].split(";")[0]) // 4
    s, e = marks[2 * i], marks[2 * i + 1]
    if lost[2 * i + 1]:
        raise SystemExit(f"profile table overflowed by {job}'s end: {lost[2 * i + 1]} instructions lost")
    return {va: (n - s.get(va, 0)) / ios for va, n in e.items() if n > s.get(va, 0)}, ios

def setup_of(job):
    return job.rsplit("-", 1)[0]

def kallsyms(job):
    syms = []
    for line in open(f"{rd}/kallsyms-{setup_of(job)}.txt"):
        w = line.split()
        if len(w) >= 3 and int(w[0], 16):
            syms.append((int(w[0], 16), w[2] + (" " + w[3] if len(w) > 3 else "")))
    return sorted(syms)

def by_symbol(win, syms, keep):
    addrs = [s[0] for s in syms]
    out = collections.Counter()
    for va, n in win.items():
        if keep(va):
            j = bisect.bisect_right(addrs, va) - 1
            out[syms[j][1] if j >= 0 else "?"] += n
    return out

kernel = lambda va: va >= 1 << 63
(bw, _), (jw, ios) = window(a.base), window(a.job)
base = by_symbol(bw, kallsyms(a.base), kernel)
job = by_symbol(jw, kallsyms(a.job), kernel)
diff = {k: job.get(k, 0) - base.get(k, 0) for k in set(job) | set(base)}
print(f"{a.job} ({ios} I/Os) minus {a.base}: kernel instructions per I/O {sum(diff.values()):+.0f}")
for k, v in sorted(diff.items(), key=lambda x: -abs(x[1]))[: a.top]:
    print(f"{v:+8.0f} {job.get(k, 0):8.0f}  {k}")

if a.agent_binary:
    base_va, ranges = None, []
    for w in (l.split() for l in open(f"{rd}/maps-{setup_of(a.job)}.txt")):
        # (the binary runs in the guest under its own file name)
        if len(w) > 5 and w[5].rsplit("/", 1)[-1] == os.path.basename(a.agent_binary):
            lo, hi = (int(x, 16) for x in w[0].split("-"))
            base_va = lo - int(w[2], 16) if base_va is None else base_va
            ranges.append((lo, hi))
    nm = subprocess.run(["nm", "-C", "--defined-only", a.agent_binary],
                        capture_output=True, text=True, check=True).stdout
    syms = sorted((int(w[0], 16) + base_va, w[2][:110])
                  for w in (l.split(" ", 2) for l in nm.splitlines())
                  if len(w) == 3 and w[1] in "tTwW")
    agent = by_symbol(jw, syms, lambda va: any(lo <= va < hi for lo, hi in ranges))
    print(f"\nthe guest agent's user space: {sum(agent.values()):.0f} instructions per I/O")
    for k, v in agent.most_common(a.top):
        print(f"{v:8.1f}  {k}")

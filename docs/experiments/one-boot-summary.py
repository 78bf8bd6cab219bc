#!/usr/bin/env python3
"""Medians of a one-boot.sh run's results (`RESULT <set-up>-<round>[-<job>] <IOPS>` lines, or
`<KiB>;<KiB/s>;<IOPS>` with INSN=1), per job and set-up, with the ratio to `none`'s median.

  one-boot-summary.py RUN_DIR        (reads RUN_DIR/results.txt, else RUN_DIR/serial.log)
"""
import os, statistics, sys

rd = sys.argv[1]
path = os.path.join(rd, "results.txt")
if not os.path.exists(path):
    path = os.path.join(rd, "serial.log")
runs, order = {}, []
for line in open(path, errors="replace"):
    w = line.split()
    if len(w) != 3 or w[0] != "RESULT":
        continue
    parts = w[1].split("-")
    setup, job = parts[0], (parts[2] if len(parts) > 2 else "qd32")
    runs.setdefault((job, setup), []).append(float(w[2].split(";")[-1]))
    if setup not in order:
        order.append(setup)
for job in sorted({j for j, _ in runs}, key=lambda j: int(j[2:]) if j[2:].isdigit() else 0, reverse=True):
    base = runs.get((job, "none"))
    b = statistics.median(base) if base else None
    for setup in order:
        v = runs.get((job, setup))
        if not v:
            continue
        m = statistics.median(v)
        ratio = f"{m / b:.3f}" if b else "-"
        print(f"{job:5} {setup:10} median {m:7.0f}  ratio {ratio}  rounds {' '.join(f'{x:.0f}' for x in sorted(v))}")

# A viotrace-vm run workload (see README.md here): tracing set-ups compared inside one boot,
# randread 4k QD32 for 4 s each, ROUNDS rounds; each run prints `RESULT <set-up>-<round> <IOPS>`
# (also appended to lab-out/results.txt). Edit the lines below to choose.
CONDITIONS="none def systp tp anchor"
ROUNDS=4
ROTATE=1 # 1: the order rotates every round; 0: the same order every round
# 1 (with `viotrace-vm run --insn-count`): each set-up runs randread QD32 and then QD1, each job
# between two instruction marks, and prints `RESULT <set-up>-<round>-<job> <KiB>;<KiB/s>;<IOPS>`;
# every set-up copies /proc/kallsyms and the agent its maps, for insn-profile.py.
INSN=0
# 1: each set-up runs randread QD32 and then QD1 (psync), `RESULT <set-up>-<round>-<job> <IOPS>`
QD1=0
set -e
fio --name=prep --filename=/data/bench.dat --size=128M --rw=write --bs=1M --direct=1 --output=/dev/null
job() { # name fio-args
  n=$1; shift
  m=""
  [ "$INSN" = 1 ] && m="--exec_prerun=viotrace-insn-mark --exec_postrun=viotrace-insn-mark"
  fio --name=$n --filename=/data/bench.dat --size=128M --direct=1 "$@" --runtime=4 --time_based \
    $m --output-format=terse --output=/out/$n.terse >/dev/null
  # (fields: read KiB;KiB/s;IOPS with INSN=1, else IOPS; not `r`: the rounds' counter)
  f=8
  [ "$INSN" = 1 ] && f=6,7,8
  echo "RESULT $n $(cut -d';' -f$f /out/$n.terse)" | tee -a /out/results.txt
}
run() {
  if [ "$INSN" != 1 ] && [ "$QD1" != 1 ]; then
    job $1 --rw=randread --bs=4k --ioengine=libaio --iodepth=32
    return
  fi
  if [ "$INSN" != 1 ]; then
    job $1-qd32 --rw=randread --bs=4k --ioengine=libaio --iodepth=32
    job $1-qd1 --rw=randread --bs=4k --ioengine=psync --iodepth=1
    return
  fi
  cat /proc/kallsyms > /out/kallsyms-$1.txt
  job $1-qd32 --rw=randread --bs=4k --ioengine=libaio --iodepth=32
  job $1-qd1 --rw=randread --bs=4k --ioengine=psync --iodepth=1
}
waitfor() { i=0; until eval "$1"; do i=$((i+1)); [ $i -gt 2400 ] && { echo "timeout $2"; exit 1; }; sleep 0.1; done; }
# Stops a tracer: SIGINT, then SIGKILL if it has not exited within 60 s. (The
# watchdog holds none of the workload's output open: the lab waits for its end.)
stop() {
  kill -INT $1
  (sleep 60; kill -KILL $1 2>/dev/null) </dev/null >/dev/null 2>&1 &
  w=$!
  wait $1 || true
  kill $w 2>/dev/null || true
}
# The guest agent (needs --guest-tool .../viotrace-guest) with extra arguments; AG names
# another build copied in (`--guest-tool /tmp/old/viotrace-guest-old`, then AG=viotrace-guest-old).
agent() {
  n=$1; shift
  rm -f /run/g.ready
  ${AG:-viotrace-guest} --ready-file /run/g.ready "$@" >/out/g-$n.out 2>/out/g-$n.log &
  echo $! > /run/g.pid
  waitfor "[ -e /run/g.ready ]" $n
  [ "$INSN" = 1 ] && cat /proc/$(cat /run/g.pid)/maps > /out/maps-$n.txt
  run $n
  stop $(cat /run/g.pid)
}
# A bpftrace program (needs --guest-tool bpftrace).
bt() {
  n=$1; shift
  bpftrace -e "$1" > /out/bt-$n.out 2>&1 &
  echo $! > /run/bt.pid
  waitfor "grep -q Attaching /out/bt-$n.out" $n
  run $n
  stop $(cat /run/bt.pid)
}
# The functions the guest agent hooks with trampolines, per I/O or per batch.
F='virtio_queue_rq virtqueue_add_sgs virtqueue_kick_prepare vring_interrupt blk_mq_complete_request blk_update_request aio_prep_rw'
ENTRY=""; EXIT=""
for f in $F; do ENTRY="$ENTRY kfunc:$f {}"; EXIT="$EXIT kretfunc:$f {}"; done
AS_AGENT='kfunc:virtio_queue_rq {} kfunc:virtqueue_add_sgs {} kretfunc:virtqueue_kick_prepare {} kfunc:vring_interrupt {} kfunc:blk_mq_complete_request {} kretfunc:blk_update_request {} kfunc:aio_prep_rw {}'
PERF_TP='tracepoint:block:block_rq_issue {} tracepoint:block:block_rq_complete {} tracepoint:block:block_rq_insert {} tracepoint:block:block_bio_queue {} tracepoint:irq:irq_handler_entry {} tracepoint:irq:irq_handler_exit {} tracepoint:block:block_getrq {}'
ANCHOR='tracepoint:block:block_rq_issue { @s[args->dev, args->sector] = nsecs; } tracepoint:block:block_rq_complete /@s[args->dev, args->sector]/ { @usecs = hist((nsecs - @s[args->dev, args->sector]) / 1000); delete(@s[args->dev, args->sector]); }'
c_none() { run none-$1; }
c_def() { agent def-$1; }
# capture mode: into the guest's RAM file system, and into /dev/null (the records without the file)
c_cap() { rm -f /out/g.cap; agent cap-$1 --capture /out/g.cap; rm -f /out/g.cap; }
c_capnull() { agent capnull-$1 --capture /dev/null; }
c_old() { AG=viotrace-guest-old agent old-$1; }
c_systp() { agent systp-$1 --syscall-tracepoints; }
c_tp() { agent tp-$1 --mode tracepoint; }
c_anchor() { bt anchor-$1 "$ANCHOR"; }
c_entry() { bt entry-$1 "$ENTRY"; }
c_exit() { bt exit-$1 "$EXIT"; }
c_fentry() { bt fentry-$1 "$AS_AGENT"; }
c_perftp() { bt perftp-$1 "$PERF_TP"; }
set -- $CONDITIONS
r=1
while [ $r -le $ROUNDS ]; do
  for c in "$@"; do c_$c $r; done
  if [ "$ROTATE" = 1 ]; then first=$1; shift; set -- "$@" $first; fi
  r=$((r+1))
done

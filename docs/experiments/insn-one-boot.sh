# A viotrace-vm run workload: guest instructions per I/O (`--insn-count`, see
# vm-tests/src/insn.rs) of tracing set-ups inside one boot. Each fio job runs between two
# instruction marks; each prints `RESULT <set-up>-<round>-<job> <read KiB>;<KiB/s>;<IOPS>`.
# The guest agent's set-up also copies its maps, every set-up /proc/kallsyms, for
# insn-profile.py (`--insn-profile`). Run as in README.md here, with --insn-count.
CONDITIONS="none def"
ROUNDS=1
set -e
fio --name=prep --filename=/data/bench.dat --size=128M --rw=write --bs=1M --direct=1 --output=/dev/null
job() { # name fio-args
  n=$1; shift
  fio --name=$n --filename=/data/bench.dat --size=128M --direct=1 "$@" --runtime=4 --time_based \
    --exec_prerun=viotrace-insn-mark --exec_postrun=viotrace-insn-mark \
    --output-format=terse --output=/out/$n.terse >/dev/null
  echo "RESULT $n $(cut -d';' -f6,7,8 /out/$n.terse)" | tee -a /out/results.txt
}
run() {
  cat /proc/kallsyms > /out/kallsyms-$1.txt
  job $1-qd32 --rw=randread --bs=4k --ioengine=libaio --iodepth=32
  job $1-qd1 --rw=randread --bs=4k --ioengine=psync --iodepth=1
}
waitfor() { i=0; until eval "$1"; do i=$((i+1)); [ $i -gt 2400 ] && { echo "timeout $2"; exit 1; }; sleep 0.1; done; }
stop() {
  kill -INT $1
  (sleep 60; kill -KILL $1 2>/dev/null) </dev/null >/dev/null 2>&1 &
  w=$!
  wait $1 || true
  kill $w 2>/dev/null || true
}
agent() {
  n=$1; shift
  rm -f /run/g.ready
  viotrace-guest --ready-file /run/g.ready "$@" >/out/g-$n.out 2>/out/g-$n.log &
  echo $! > /run/g.pid
  waitfor "[ -e /run/g.ready ]" $n
  cat /proc/$(cat /run/g.pid)/maps > /out/maps-$n.txt
  run $n
  stop $(cat /run/g.pid)
}
bt() {
  n=$1; shift
  bpftrace -e "$1" > /out/bt-$n.out 2>&1 &
  echo $! > /run/bt.pid
  waitfor "grep -q Attaching /out/bt-$n.out" $n
  run $n
  stop $(cat /run/bt.pid)
}
ANCHOR='tracepoint:block:block_rq_issue { @s[args->dev, args->sector] = nsecs; } tracepoint:block:block_rq_complete /@s[args->dev, args->sector]/ { @usecs = hist((nsecs - @s[args->dev, args->sector]) / 1000); delete(@s[args->dev, args->sector]); }'
c_none() { run none-$1; }
c_def() { agent def-$1; }
c_anchor() { bt anchor-$1 "$ANCHOR"; }
set -- $CONDITIONS
r=1
while [ $r -le $ROUNDS ]; do
  for c in "$@"; do c_$c $r; done
  first=$1; shift; set -- "$@" $first
  r=$((r+1))
done

# A viotrace-vm run workload for tb-lookups.sh: fio randread 4k QD1 psync for 45 s on a 100 MiB
# file, with the guest agent (AGENT=1, needs --guest-tool .../viotrace-guest; extra arguments in
# ARGS), the bench's bpftrace anchor (AGENT=anchor, needs --guest-tool bpftrace) or neither
# (AGENT=0); the guest's /proc/kallsyms is copied to /out/kallsyms.txt first.
AGENT=${AGENT:-1}
ARGS=""
set -e
fio --name=prep --filename=/data/q.dat --size=100M --rw=write --bs=1M --direct=1 --output=/dev/null
if [ "$AGENT" = 1 ]; then
  rm -f /run/g.ready
  viotrace-guest --ready-file /run/g.ready $ARGS >/out/g.out 2>/out/g.log &
  i=0; until [ -e /run/g.ready ]; do i=$((i+1)); [ $i -gt 2400 ] && exit 1; sleep 0.1; done
elif [ "$AGENT" = anchor ]; then
  bpftrace -e 'tracepoint:block:block_rq_issue { @s[args->dev, args->sector] = nsecs; }
    tracepoint:block:block_rq_complete /@s[args->dev, args->sector]/ {
      @usecs = hist((nsecs - @s[args->dev, args->sector]) / 1000);
      delete(@s[args->dev, args->sector]); }' >/out/bt.out 2>&1 &
  i=0; until grep -q Attaching /out/bt.out; do i=$((i+1)); [ $i -gt 2400 ] && exit 1; sleep 0.1; done
fi
cat /proc/kallsyms > /out/kallsyms.txt
fio --name=q --filename=/data/q.dat --size=100M --direct=1 --rw=randread --bs=4k \
  --ioengine=psync --iodepth=1 --runtime=45 --time_based --output-format=terse --output=/out/q.terse
echo "RESULT q $(cut -d';' -f6,7,8 /out/q.terse)"
if [ "$AGENT" != 0 ]; then kill -INT %1; wait || true; fi

#!/bin/busybox sh
# viotrace lab guest init: mounts, loads virtio modules, runs the agent and the workload,
# ships /out to the host over a virtio-serial port and powers off. Markers on the
# console (VIOTRACE-*) are read by the host side of the lab.
/bin/busybox --install -s /bin
export PATH=/usr/local/bin:/usr/bin:/bin:/sbin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /run /tmp /out /data
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
mount -t bpf bpf /sys/fs/bpf 2>/dev/null
hostname viotrace-guest
ip link set lo up 2>/dev/null

fail() {
	echo "VIOTRACE-ERROR $*"
	sync
	poweroff -f
	sleep 5
}

. /viotrace/config.sh
# The workload may restart the guest agent with the same arguments.
export VIOTRACE_GUEST_ARGS

# The modules this kernel needs (virtio, virtio-blk, vsock, …), in dependency order; the
# ones built into this kernel are not listed.
for m in $(cat /lib/modules/order); do
	insmod /lib/modules/$m.ko 2>/tmp/insmod.err || grep -q 'File exists' /tmp/insmod.err ||
		fail "insmod $m: $(cat /tmp/insmod.err)"
done

# Wait for the data disk.
i=0
while [ ! -b /dev/$VIOTRACE_DISK ]; do
	i=$((i + 1))
	[ $i -gt 100 ] && fail "data disk /dev/$VIOTRACE_DISK did not appear"
	sleep 0.1
done
mount -t ext4 -o noatime /dev/$VIOTRACE_DISK /data || fail "mount /dev/$VIOTRACE_DISK"
export VIOTRACE_DISK

# Find the results port.
RESULTS=
i=0
while [ -z "$RESULTS" ]; do
	for p in /sys/class/virtio-ports/*; do
		[ "$(cat $p/name 2>/dev/null)" = viotrace.results ] && RESULTS=/dev/$(basename $p)
	done
	i=$((i + 1))
	[ $i -gt 100 ] && fail "results port did not appear"
	[ -z "$RESULTS" ] && sleep 0.1
done

# Booted: kernel, modules and disks up, nothing of the run's own started yet (the lab
# boots again once when this line does not come: a boot that hung under emulation).
echo "VIOTRACE-BOOTED"
sh /viotrace/setup.sh </dev/null >/out/setup.log 2>&1 || fail "setup script failed: $(tail -n 5 /out/setup.log)"

AGENT_PID=
if [ "$VIOTRACE_GUEST_AGENT" = 1 ]; then
	echo "VIOTRACE-AGENT-START"
	eval "set -- $VIOTRACE_GUEST_ARGS"
	/bin/viotrace-guest $VIOTRACE_GUEST_OUTPUT --ready-file /run/viotrace-guest.ready "$@" \
		>/out/guest.jsonl 2>/out/guest.log &
	AGENT_PID=$!
	i=0
	while [ ! -e /run/viotrace-guest.ready ]; do
		if ! kill -0 $AGENT_PID 2>/dev/null; then
			wait $AGENT_PID
			echo "VIOTRACE-AGENT-FAILED rc=$?"
			tail -n 20 /out/guest.log
			AGENT_PID=
			break
		fi
		i=$((i + 1))
		[ $i -gt 1200 ] && { echo "VIOTRACE-AGENT-FAILED not ready after 120 s"; break; }
		sleep 0.1
	done
	[ -n "$AGENT_PID" ] && echo "VIOTRACE-AGENT-READY"
fi

# CPU time and memory of the agent over the workload (for overhead measurements).
agent_sample() {
	[ -n "$AGENT_PID" ] || return 0
	cat /proc/$AGENT_PID/stat >/out/guest-agent.$1.stat 2>/dev/null
	cat /proc/$AGENT_PID/status >/out/guest-agent.$1.status 2>/dev/null
	cat /proc/$AGENT_PID/smaps_rollup >/out/guest-agent.$1.smaps_rollup 2>/dev/null
}
agent_sample start
# A workload still running near the run's deadline leaves evidence on the console:
# each virtio disk's requests in flight (a lost completion shows here, while its
# waiter may sleep interruptibly, as libaio's io_getevents does), every user
# task's state, wait channel and kernel stack, the kernel log's tail, then the
# blocked tasks (sysrq w).
hang_dump() {
	echo "VIOTRACE-HANG-DUMP (disks, user tasks, blocked tasks follow)"
	for d in /sys/block/vd*; do
		[ -e "$d" ] || continue
		echo "disk ${d##*/}: in flight (reads writes): $(cat $d/inflight)"
		for b in /sys/kernel/debug/block/${d##*/}/hctx*/busy; do
			[ -e "$b" ] && head -n 8 "$b" | sed "s|^|  ${b#/sys/kernel/debug/block/}: |"
		done
	done
	for t in /proc/[0-9]*/task/[0-9]*; do
		cmd=$(tr '\0' ' ' <$t/cmdline 2>/dev/null)
		[ -n "$cmd" ] || continue # a kernel thread
		name=$(sed -n 's/^Name:[[:space:]]*//p' $t/status 2>/dev/null)
		case "$name" in sh | tee | cat | sed | head | tr) continue ;; esac # shells, this dump
		state=$(sed -n 's/^State:[[:space:]]*//p' $t/status 2>/dev/null)
		pid=${t#/proc/}
		echo "task ${pid%%/*}/${t##*/} $name [$state] wchan=$(cat $t/wchan 2>/dev/null): $cmd"
		sed 's/^/    /' $t/stack 2>/dev/null
	done
	# what the quiet console left out (an OOM kill, a warning, a lockup)
	echo "kernel log, last 40 lines:"
	dmesg | tail -n 40 | sed 's/^/    /'
	echo 8 >/proc/sys/kernel/printk
	echo w >/proc/sysrq-trigger
}
DUMP_PID=
if [ -n "$VIOTRACE_DUMP_AFTER" ]; then
	(sleep "$VIOTRACE_DUMP_AFTER" && hang_dump) &
	DUMP_PID=$!
fi
echo "VIOTRACE-WORKLOAD-START"
cd /data
(sh /viotrace/workload.sh; echo $? >/tmp/workload.rc) 2>&1 | tee /out/workload.log
cd /
[ -n "$DUMP_PID" ] && kill $DUMP_PID 2>/dev/null
rc=$(cat /tmp/workload.rc 2>/dev/null || echo 255)
echo "VIOTRACE-WORKLOAD-END rc=$rc"
agent_sample end
# After the measured window, with the agent still running (e.g. the bench's BPF
# accounting pass).
if [ -s /viotrace/post.sh ]; then
	# (fd 3: the console, for lines to the lab, e.g. VIOTRACE-HOST-BPF-SAMPLE)
	(cd /data && sh /viotrace/post.sh) </dev/null 3>&1 >/out/post.log 2>&1
	echo $? >/out/post.rc
fi

if [ -n "$AGENT_PID" ]; then
	kill -INT $AGENT_PID 2>/dev/null
	i=0
	while kill -0 $AGENT_PID 2>/dev/null; do
		i=$((i + 1))
		if [ $i -gt 300 ]; then
			echo "VIOTRACE-AGENT-KILLED did not stop within 30 s of SIGINT"
			kill -KILL $AGENT_PID
			break
		fi
		sleep 0.1
	done
	wait $AGENT_PID
	echo "VIOTRACE-AGENT-EXIT rc=$?"
fi

echo $rc >/out/workload.rc
umount /data 2>/dev/null
tar -c -f - -C /out . >$RESULTS || echo "VIOTRACE-ERROR shipping results failed"
sync
echo "VIOTRACE-DONE"
poweroff -f
sleep 10

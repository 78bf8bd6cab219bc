#!/bin/sh
# What one uprobe hit costs on this host, by the probed instruction: a C loop
# calls a function N times, and a bpftrace count() uprobe sits on one of its
# instructions at a time. The kernel emulates some instructions in the trap
# (push, jcc, jmp, one-byte nop, call), single-steps a copy of the others (a
# second trap), and on 6.18+ turns a probed 5-byte nop into a call. See
# docs/PERFORMANCE.md, "The host agent's uprobes on an instruction the kernel
# emulates". Needs gcc and bpftrace; root.
set -eu
N=${N:-200000}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
cat > "$DIR/t.c" <<'C'
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#define SITE(name) ".globl " #name "\n .type " #name ",@function\n " #name ":\n .size " #name ",1\n\t"
__attribute__((noinline)) long f(long a, long b, long c, long d, long e, long g) {
    __asm__ volatile(
        SITE(at_sub) "sub $8,%%rsp\n\t"
        "add $8,%%rsp\n\t"
        SITE(at_push) "push %%r9\n\t"
        "pop %%r9\n\t"
        SITE(at_nop) "nop\n\t"
        SITE(at_nop5) ".byte 0x0f,0x1f,0x44,0x00,0x00\n\t"
        "test %%rsp,%%rsp\n\t"
        SITE(at_js) "js 2f\n\t"
        SITE(at_call) "call 1f\n\t"
        "1: add $8,%%rsp\n\t"
        "2:\n\t"
        ::: "memory", "cc");
    return a + b + c + d + e + g;
}
int main(int argc, char **argv) {
    long n = atol(argv[1]), s = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i++)
        s += f(i, 1, 2, 3, 4, 5);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%.1f ns/call (%ld)\n",
           ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / n, s & 1);
    return 0;
}
C
gcc -O2 -o "$DIR/t" "$DIR/t.c"
printf '%-10s %s\n' "none" "$("$DIR/t" "$N")"
for site in at_sub at_push at_nop at_nop5 at_js at_call; do
    r=$(bpftrace -q -e "uprobe:$DIR/t:$site { @n = count(); }" -c "$DIR/t $N" 2>/dev/null |
        grep ns/call || echo "failed")
    printf '%-10s %s\n' "$site" "$r"
done

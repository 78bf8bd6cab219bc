/*
 * What a wakeup costs on this machine: the same work timed right after a
 * 250 ms sleep and back to back (docs/PERFORMANCE.md, "Fewer wakeups").
 *   cc -O2 -o /tmp/wake-cost scripts/wake-cost.c && /tmp/wake-cost
 */
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static char buf[1 << 20];

static long now_ns(clockid_t c)
{
	struct timespec t;
	clock_gettime(c, &t);
	return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* `calls` getppid, then one read every `stride` bytes of the first `bytes`. */
static long work(int calls, long bytes, long stride)
{
	long s = 0;
	for (int i = 0; i < calls; i++)
		s += syscall(SYS_getppid);
	for (long i = 0; i < bytes; i += stride)
		s += buf[i]++;
	return s;
}

static void case_(const char *what, int calls, long bytes, long stride)
{
	long sink = 0;
	for (int r = 0; r < 3; r++)
		sink += work(calls, bytes, stride);
	for (int cold = 1; cold >= 0; cold--) {
		long cpu = 0;
		for (int r = 0; r < 20; r++) {
			if (cold)
				usleep(250000);
			long c0 = now_ns(CLOCK_THREAD_CPUTIME_ID);
			sink += work(calls, bytes, stride);
			cpu += now_ns(CLOCK_THREAD_CPUTIME_ID) - c0;
		}
		printf("%-48s %-22s %6ld us CPU\n", what, cold ? "after a 250 ms sleep:" : "back to back:",
		       cpu / 20 / 1000);
	}
	if (sink == 42)
		puts("");
}

int main(void)
{
	case_("20 getppid + a read per line of 1 MiB", 20, 1 << 20, 64);
	case_("20 getppid + a read per line of 64 KiB", 20, 1 << 16, 64);
	case_("20 getppid + one line in each of 256 pages", 20, 1 << 20, 4096);
	case_("a read per line of 1 MiB, no syscalls", 0, 1 << 20, 64);
	return 0;
}

// SPDX-License-Identifier: GPL-2.0
/*
 * viotrace-insn-mark: executes CPUID three times in a row and exits. Under the
 * lab's instruction-count plugin (insn_count.c) this writes one mark line with
 * the guest's instruction counts. Static, no C library.
 */
static inline void cpuid0(void)
{
	unsigned int a = 0, b, c = 0, d;

	__asm__ volatile("cpuid" : "+a"(a), "=b"(b), "+c"(c), "=d"(d));
}

void _start(void)
{
	cpuid0();
	cpuid0();
	cpuid0();
	__asm__ volatile("mov $60, %eax\n\txor %edi, %edi\n\tsyscall");
	__builtin_unreachable();
}

// SPDX-License-Identifier: GPL-2.0
/*
 * viotrace-insn-mark: loads EAX with "VIOT" and executes CPUID, then exits.
 * Under the lab's instruction-count plugin (insn_count.c) this writes one mark
 * line with the guest's instruction counts. Static, no C library.
 */
void _start(void)
{
	__asm__ volatile("mov $0x56494f54, %%eax\n\t"
			 "cpuid\n\t"
			 "mov $60, %%eax\n\t"
			 "xor %%edi, %%edi\n\t"
			 "syscall"
			 ::: "eax", "ebx", "ecx", "edx", "edi", "memory");
	__builtin_unreachable();
}

/* SPDX-License-Identifier: GPL-2.0 */
/* libbpf's usdt.bpf.h includes <linux/errno.h>, which wants the arch header; the
 * BPF target has none: the generic errno values are the x86-64 ones. */
#include <asm-generic/errno.h>

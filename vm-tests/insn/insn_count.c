// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * A QEMU TCG plugin (plugin API version 1, QEMU 7.2 and later 1-API builds)
 * that counts the guest instructions executed, by where their code lies:
 * user space, the kernel image, and the module area, where the kernel also
 * puts BPF programs and trampolines (x86-64 only).
 *
 * A guest marks a moment by executing CPUID right after loading EAX with the
 * constant "VIOT" (viotrace-insn-mark): firmware and kernels run CPUID too,
 * never after that load. Each mark appends one line to the output file:
 *   mark <n> user <u> kernel <k> modules <m> other <o>
 * Counts are per translated block, added when the block starts; with more
 * than one vCPU the adds race (the lab's bench runs one vCPU).
 *
 * Arguments: out=<file>; profile=<file> also counts instructions per
 * translated block's start address and writes them at each mark (`mark <n>
 * lost <l>`, then `<address hex> <count>` lines, counts since the start, of
 * the blocks whose count changed since the previous mark: a reader carries the
 * others over), for a profile by symbol: kernel ones from /proc/kallsyms (BPF
 * programs and trampolines included), user ones from a process's maps and its
 * binary's symbols. A block's counter is bound to it when it is translated, so
 * slots are never reused: every process and BPF program a boot starts adds
 * blocks at addresses of their own, and the table holds 4 M of them (a boot of
 * six set-ups overflowed 1 M).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stddef.h>
#include <stdbool.h>

/* The plugin ABI, version 1: only what this plugin uses. */
typedef uint64_t qemu_plugin_id_t;
struct qemu_plugin_tb;
struct qemu_plugin_insn;
typedef struct {
	const char *target_name;
	struct {
		int min;
		int cur;
	} version;
	bool system_emulation;
} qemu_info_t;
enum qemu_plugin_cb_flags { QEMU_PLUGIN_CB_NO_REGS };
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };
typedef void (*qemu_plugin_vcpu_tb_trans_cb_t)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
typedef void (*qemu_plugin_vcpu_udata_cb_t)(unsigned int vcpu_index, void *userdata);
typedef void (*qemu_plugin_udata_cb_t)(qemu_plugin_id_t id, void *userdata);
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_tb_trans_cb_t cb);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum qemu_plugin_op op,
					      void *ptr, uint64_t imm);
void qemu_plugin_register_vcpu_insn_exec_cb(struct qemu_plugin_insn *insn,
					    qemu_plugin_vcpu_udata_cb_t cb,
					    enum qemu_plugin_cb_flags flags, void *userdata);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
uint64_t qemu_plugin_tb_vaddr(const struct qemu_plugin_tb *tb);
struct qemu_plugin_insn *qemu_plugin_tb_get_insn(const struct qemu_plugin_tb *tb, size_t idx);
const void *qemu_plugin_insn_data(const struct qemu_plugin_insn *insn);
size_t qemu_plugin_insn_size(const struct qemu_plugin_insn *insn);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, qemu_plugin_udata_cb_t cb, void *userdata);

#define EXPORT __attribute__((visibility("default")))
EXPORT int qemu_plugin_version = 1;

enum region { R_USER, R_KERNEL, R_MODULES, R_OTHER, R_NR };
static const char *const region_name[R_NR] = { "user", "kernel", "modules", "other" };
static uint64_t counts[R_NR];
static FILE *out;
static uint64_t marks;

/* profile: blocks by start address, user and kernel (open addressing; full: counted in `lost`) */
#define PROF_BITS 22
#define PROF_SLOTS (1u << PROF_BITS)
struct prof_slot {
	uint64_t vaddr;
	uint64_t count;
	uint64_t written;	/* the count at the last mark */
};
static struct prof_slot *prof;
static FILE *prof_out;
static uint64_t prof_lost;

static uint64_t *prof_counter(uint64_t va)
{
	/* Fibonacci hashing: the product's high bits */
	uint64_t h = (va * 0x9e3779b97f4a7c15ULL) >> (64 - PROF_BITS);

	for (uint32_t i = 0; i < 256; i++) {
		struct prof_slot *s = &prof[(h + i) & (PROF_SLOTS - 1)];

		if (s->vaddr == va)
			return &s->count;
		if (!s->vaddr) {
			s->vaddr = va;
			return &s->count;
		}
	}
	return &prof_lost;
}

static void write_profile(void)
{
	fprintf(prof_out, "mark %llu lost %llu\n", (unsigned long long)marks,
		(unsigned long long)prof_lost);
	for (uint32_t i = 0; i < PROF_SLOTS; i++) {
		if (prof[i].count != prof[i].written) {
			fprintf(prof_out, "%llx %llu\n", (unsigned long long)prof[i].vaddr,
				(unsigned long long)prof[i].count);
			prof[i].written = prof[i].count;
		}
	}
	fflush(prof_out);
}

/* mov $0x56494f54, %eax ("VIOT"), then cpuid: the marker's two instructions */
static const uint8_t MARK_MOV[5] = { 0xb8, 0x54, 0x4f, 0x49, 0x56 };
static const uint8_t CPUID[2] = { 0x0f, 0xa2 };

/* x86-64, 4-level or 5-level paging: user below the canonical hole; the
 * kernel image in [-2 GiB, -1 GiB); modules, BPF programs and trampolines
 * from -1 GiB up to the fixmap. */
static enum region region_of(uint64_t va)
{
	if (va < 0x8000000000000000ULL)
		return R_USER;
	if (va >= 0xffffffff80000000ULL && va < 0xffffffffc0000000ULL)
		return R_KERNEL;
	if (va >= 0xffffffffc0000000ULL && va < 0xffffffffff000000ULL)
		return R_MODULES;
	return R_OTHER;
}

static void write_counts(const char *what)
{
	fprintf(out, "%s %llu", what, (unsigned long long)marks);
	for (int i = 0; i < R_NR; i++)
		fprintf(out, " %s %llu", region_name[i], (unsigned long long)counts[i]);
	fputc('\n', out);
	fflush(out);
}

static void on_mark(unsigned int vcpu, void *udata)
{
	(void)vcpu;
	(void)udata;
	marks++;
	write_counts("mark");
	if (prof_out)
		write_profile();
}

static bool insn_is(const struct qemu_plugin_insn *insn, const uint8_t *bytes, size_t len)
{
	return qemu_plugin_insn_size(insn) == len &&
	       memcmp(qemu_plugin_insn_data(insn), bytes, len) == 0;
}

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
	size_t n = qemu_plugin_tb_n_insns(tb);
	uint64_t va = qemu_plugin_tb_vaddr(tb);
	enum region r = region_of(va);

	(void)id;
	qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &counts[r], n);
	if (prof)
		qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64,
							 prof_counter(va), n);
	/* (the marker's pair lies in one block: it is the start of a tiny program) */
	for (size_t i = 1; i < n; i++) {
		struct qemu_plugin_insn *insn = qemu_plugin_tb_get_insn(tb, i);

		if (insn_is(insn, CPUID, sizeof(CPUID)) &&
		    insn_is(qemu_plugin_tb_get_insn(tb, i - 1), MARK_MOV, sizeof(MARK_MOV)))
			qemu_plugin_register_vcpu_insn_exec_cb(insn, on_mark, QEMU_PLUGIN_CB_NO_REGS,
							       NULL);
	}
}

static void on_qemu_exit(qemu_plugin_id_t id, void *udata)
{
	(void)id;
	(void)udata;
	write_counts("exit");
	fclose(out);
	if (prof_out)
		fclose(prof_out);
}

EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc, char **argv)
{
	const char *path = NULL, *prof_path = NULL;

	if (strcmp(info->target_name, "x86_64") != 0) {
		fprintf(stderr, "insn_count: x86_64 guests only, not %s\n", info->target_name);
		return -1;
	}
	for (int i = 0; i < argc; i++) {
		if (strncmp(argv[i], "out=", 4) == 0)
			path = argv[i] + 4;
		else if (strncmp(argv[i], "profile=", 8) == 0)
			prof_path = argv[i] + 8;
	}
	if (!path) {
		fprintf(stderr, "insn_count: out=<file> is required\n");
		return -1;
	}
	out = fopen(path, "w");
	if (!out) {
		perror("insn_count: out");
		return -1;
	}
	if (prof_path) {
		prof = calloc(PROF_SLOTS, sizeof(*prof));
		prof_out = fopen(prof_path, "w");
		if (!prof || !prof_out) {
			perror("insn_count: profile");
			return -1;
		}
	}
	qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
	qemu_plugin_register_atexit_cb(id, on_qemu_exit, NULL);
	return 0;
}

/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Kernel objects as map keys: pointer arguments as numbers (fentry and tp_btf
 * programs), and the direct-mapped tables whose slot is found from the key
 * without a hash lookup (requests, virtqueues, threads: guest_common.h).
 */
#ifndef VIOTRACE_GUEST_KEYS_H
#define VIOTRACE_GUEST_KEYS_H

/*
 * A direct-mapped table (see dm_find, below): `name`_slots, an array of
 * `slot_type` (its owner's key first), and `name`_claims, which arbitrates
 * the claim of each slot (index → owner).
 */
#define DM_TABLE(name, nslots, slot_type)				\
struct {								\
	__uint(type, BPF_MAP_TYPE_ARRAY);				\
	__uint(max_entries, nslots);					\
	__type(key, __u32);						\
	__type(value, slot_type);					\
} name##_slots SEC(".maps");						\
struct {								\
	__uint(type, BPF_MAP_TYPE_HASH);				\
	__uint(max_entries, nslots);					\
	__type(key, __u32);						\
	__type(value, __u64);						\
} name##_claims SEC(".maps")

static __always_inline __u32 ptr_slot(__u64 p, __u32 slots)
{
	return (__u32)((p >> 6) ^ (p >> 12) ^ (p >> 20)) & (slots - 1);
}

/*
 * Direct-mapped state (requests, virtqueues): an array whose values start
 * with their owner's key (a kernel pointer, 0: free). Slot ptr_slot(key) holds
 * the state of the first object that needed it, for good: these objects are
 * allocated once and reused (a queue's requests, one per tag; its
 * virtqueues). Finding a state is then an array access, which the verifier
 * inlines, where a hash lookup is a helper call, a hash and a bucket walk. An
 * object whose slot another one holds keeps its state in a hash map, as all
 * did before. A slot is claimed by an atomic insert of its index into a claims
 * map (BPF_NOEXIST), so two CPUs never take the same one. Objects freed for
 * good (a scheduler switch, a removed disk) keep their slots: later objects
 * that map there use the hash map.
 */
/*
 * Direct-mapped slots need the key as a plain number (for ptr_slot). A fentry
 * program's pointer argument keeps its BTF type, on which the verifier refuses
 * arithmetic; bpf_get_func_arg (5.17+, inlined) gives it as a number. Older
 * kernels use the hash maps only: there, dm_find and dm_claim are dead code.
 */
#define DM_ON bpf_core_enum_value_exists(enum bpf_func_id, BPF_FUNC_get_func_arg)

/* Argument n of a fentry/fexit program, `ptr`, as a map key. */
static __always_inline __u64 arg_key(void *ctx, __u32 n, const void *ptr)
{
	__u64 v = (__u64)ptr;

	if (DM_ON)
		bpf_get_func_arg(ctx, n, &v);
	return v;
}

/*
 * A tp_btf program's typed pointer as a number (a map key, a direct-mapped
 * slot, a global function's argument), where bpf_get_func_arg is not offered.
 * The verifier lets a privileged program subtract two pointers, which gives a
 * number, and bpf_get_current_task gives the current task's address as one:
 * p = task + (p - task), NULL included. 5.11+ (bpf_get_current_task_btf); the
 * planner loads the programs that use it only there.
 */
struct typed_base {
	struct task_struct *t;	/* the current task, typed */
	__u64 addr;		/* the same, as a number */
};

static __always_inline struct typed_base typed_base(void)
{
	struct typed_base b = { .t = bpf_get_current_task_btf(), .addr = bpf_get_current_task() };

	return b;
}

static __always_inline __u64 typed_addr(const struct typed_base *b, const void *p)
{
	__u64 d = (__u64)p;

	/* (in asm: the compiler would fold it to p - t + addr, or addr - t first,
	 * which the verifier refuses) */
	asm volatile("%0 -= %1" : "+r"(d) : "r"(b->t));
	return d + b->addr;
}

/* The slot of `key` (its owner's key first), or NULL without slots. */
static __always_inline __u64 *dm_slot(void *slots, __u32 nslots, __u64 key, __u32 *i)
{
	if (!DM_ON)
		return NULL;
	*i = ptr_slot(key, nslots);
	return bpf_map_lookup_elem(slots, i);
}

static __always_inline void *dm_find(void *slots, __u32 nslots, __u64 key)
{
	__u32 i;
	__u64 *owner = dm_slot(slots, nslots, key, &i);

	return owner && *owner == key ? owner : NULL;
}

/* Claims the slot of `key` (which has none): the slot's zeroed value, or NULL
 * when it is taken. */
static __always_inline void *dm_claim(void *slots, void *claims, __u32 nslots, __u64 key)
{
	__u32 i;
	__u64 *owner = dm_slot(slots, nslots, key, &i);

	if (!owner || *owner || bpf_map_update_elem(claims, &i, &key, BPF_NOEXIST))
		return NULL;
	*owner = key;
	return owner;
}

#endif

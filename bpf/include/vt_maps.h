/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Map entries created on demand, for both BPF objects (guest and host). The
 * includer defines `stat_inc(__u32)` first: a map too full for a new entry is
 * counted there, never silent.
 */
#ifndef VT_MAPS_H
#define VT_MAPS_H

/* Creates (or returns) the entry for key; counts a full map. */
static __always_inline void *map_create(void *map, const void *key, const void *zero, __u32 full_stat)
{
	void *v = bpf_map_lookup_elem(map, key);

	if (v)
		return v;
	if (bpf_map_update_elem(map, key, zero, BPF_NOEXIST)) {
		v = bpf_map_lookup_elem(map, key);
		if (!v)
			stat_inc(full_stat);
		return v;
	}
	return bpf_map_lookup_elem(map, key);
}

/*
 * The same when the caller expects no entry (it just looked, or the key is
 * new): insert first, then one lookup — two map operations instead of three.
 * An entry that exists after all (a leftover) is returned as is.
 */
static __always_inline void *map_insert(void *map, const void *key, const void *zero, __u32 full_stat)
{
	void *v;

	bpf_map_update_elem(map, key, zero, BPF_NOEXIST);
	v = bpf_map_lookup_elem(map, key);
	if (!v)
		stat_inc(full_stat);
	return v;
}

#endif

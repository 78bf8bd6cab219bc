//! Reads structure offsets out of QEMU's small exported accessors
//! (`virtio_get_queue_index`, `virtio_queue_get_*_notifier`, `blk_name`, …).
//!
//! Each accessor is decoded with a real x86-64 decoder (iced-x86) and run
//! through a tiny abstract interpreter that tracks, per register, whether it
//! holds the first argument plus a constant (`&arg->field`), a value loaded
//! from such an address (`arg->field`), or something else. Prologue and
//! epilogue noise of real builds is accepted: `endbr64`, NOPs,
//! `-fzero-call-used-regs` clears (`xor edi,edi` / `xor edx,edx` before `ret`),
//! `test`/`cmp`, and a `cmov` that substitutes a default (`blk->name ?: ""`).
//! Anything else (a call, a branch, a store) gives no answer: an offset is then
//! "not confirmed", never guessed.

use iced_x86::{Decoder, DecoderOptions, Instruction, Mnemonic, OpKind, Register};

/// What an accessor returns, in terms of its first argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Returns {
    /// `&arg->field`: the argument plus this offset.
    Addr(u32),
    /// `arg->field`: a load of `size` bytes at this offset.
    Load { off: u32, size: u8 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Val {
    Unknown,
    /// First argument + offset.
    Arg(i64),
    /// Loaded from first argument + offset.
    Load(i64, u8),
    /// A constant or an address that does not depend on the argument.
    Other,
}

/// At most this many instructions are looked at (accessors are tiny).
const MAX_INSNS: usize = 24;

fn reg_index(r: Register) -> Option<usize> {
    let full = r.full_register();
    let i = full.number().checked_sub(Register::RAX.number())?;
    (i < 16).then_some(i)
}

/// Interprets the code of an accessor (its first bytes; more is fine) and says
/// what it returns in rax, or None when the code is not a plain accessor.
pub fn accessor_returns(code: &[u8]) -> Option<Returns> {
    let mut regs = [Val::Unknown; 16];
    regs[reg_index(Register::RDI)?] = Val::Arg(0);
    let mut dec = Decoder::with_ip(64, code, 0, DecoderOptions::NONE);
    let mut ins = Instruction::default();
    for _ in 0..MAX_INSNS {
        if !dec.can_decode() {
            return None;
        }
        dec.decode_out(&mut ins);
        if ins.is_invalid() {
            return None;
        }
        match ins.mnemonic() {
            Mnemonic::Ret => {
                return match regs[reg_index(Register::RAX)?] {
                    Val::Arg(d) => Some(Returns::Addr(u32::try_from(d).ok()?)),
                    Val::Load(d, size) => Some(Returns::Load {
                        off: u32::try_from(d).ok()?,
                        size,
                    }),
                    Val::Unknown | Val::Other => None,
                };
            }
            Mnemonic::Endbr64 | Mnemonic::Nop | Mnemonic::Test | Mnemonic::Cmp => {}
            Mnemonic::Xor | Mnemonic::Sub
                if ins.op0_kind() == OpKind::Register
                    && ins.op1_kind() == OpKind::Register
                    && ins.op0_register() == ins.op1_register() =>
            {
                regs[reg_index(ins.op0_register())?] = Val::Other;
            }
            Mnemonic::Lea => {
                let v = mem_addr(&ins, &regs)?;
                set(&mut regs, &ins, v)?;
            }
            Mnemonic::Mov | Mnemonic::Movzx => {
                let v = match ins.op1_kind() {
                    OpKind::Memory => match mem_addr(&ins, &regs)? {
                        Val::Arg(d) => Val::Load(d, mem_size(&ins)?),
                        _ => Val::Other,
                    },
                    OpKind::Register => regs[reg_index(ins.op1_register())?],
                    _ => Val::Other, // immediates
                };
                if ins.op0_kind() != OpKind::Register {
                    return None; // a store: not an accessor
                }
                set(&mut regs, &ins, v)?;
            }
            Mnemonic::Add if ins.op0_kind() == OpKind::Register => {
                let r = reg_index(ins.op0_register())?;
                regs[r] = match (regs[r], ins.op1_kind()) {
                    (Val::Arg(d), OpKind::Immediate8to64 | OpKind::Immediate32to64) => {
                        Val::Arg(d + ins.immediate(1) as i64)
                    }
                    _ => Val::Unknown,
                };
            }
            // `cmovCC rax, rdx` after `test rax,rax`: a default for a NULL field
            // (blk_name: `blk->name ?: ""`). The field load stays the answer.
            m if is_cmov(m) => {
                let r = reg_index(ins.op0_register())?;
                if !matches!(regs[r], Val::Load(..) | Val::Arg(_)) {
                    regs[r] = Val::Unknown;
                }
            }
            _ => return None,
        }
    }
    None
}

fn is_cmov(m: Mnemonic) -> bool {
    matches!(
        m,
        Mnemonic::Cmove
            | Mnemonic::Cmovne
            | Mnemonic::Cmova
            | Mnemonic::Cmovae
            | Mnemonic::Cmovb
            | Mnemonic::Cmovbe
            | Mnemonic::Cmovg
            | Mnemonic::Cmovge
            | Mnemonic::Cmovl
            | Mnemonic::Cmovle
            | Mnemonic::Cmovs
            | Mnemonic::Cmovns
    )
}

fn set(regs: &mut [Val; 16], ins: &Instruction, v: Val) -> Option<()> {
    if ins.op0_kind() != OpKind::Register {
        return None;
    }
    regs[reg_index(ins.op0_register())?] = v;
    Some(())
}

/// The size of the memory operand, in bytes.
fn mem_size(ins: &Instruction) -> Option<u8> {
    let s = ins.memory_size().size();
    u8::try_from(s).ok().filter(|&s| s > 0)
}

/// The address a memory operand computes, in terms of the argument.
fn mem_addr(ins: &Instruction, regs: &[Val; 16]) -> Option<Val> {
    if ins.memory_base() == Register::RIP || ins.is_ip_rel_memory_operand() {
        return Some(Val::Other);
    }
    if ins.memory_index() != Register::None || ins.segment_prefix() != Register::None {
        return Some(Val::Unknown);
    }
    let base = ins.memory_base();
    if base == Register::None {
        return Some(Val::Other);
    }
    let disp = ins.memory_displacement64() as i64;
    Some(match regs[reg_index(base)?] {
        Val::Arg(d) => Val::Arg(d + disp),
        _ => Val::Unknown,
    })
}

/// The offset of a device's `BlockBackend *` field, from the code of the device
/// model: the displacement of `mov disp(%reg),%rdi` loads that are followed
/// (within three instructions) by a direct call to a `blk_*` function
/// (`blk_name(s->blk)`, `blk_get_aio_context(s->blk)`, …). `code` starts at a
/// function boundary at address `base`. The most frequent displacement in
/// `range` wins when it is seen at least `min_hits` times and more than twice as
/// often as any other; returns (offset, hits).
pub fn blk_field_from_calls(
    code: &[u8],
    base: u64,
    is_blk_fn: impl Fn(u64) -> bool,
    range: std::ops::Range<u32>,
    min_hits: u32,
) -> Option<(u32, u32)> {
    let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    let mut dec = Decoder::with_ip(64, code, base, DecoderOptions::NONE);
    let mut ins = Instruction::default();
    // (displacement, instructions since the load)
    let mut pending: Option<(u32, u8)> = None;
    while dec.can_decode() {
        dec.decode_out(&mut ins);
        if let Some((d, n)) = pending {
            if ins.mnemonic() == Mnemonic::Call && ins.op0_kind() == OpKind::NearBranch64 {
                if is_blk_fn(ins.near_branch_target()) {
                    *counts.entry(d).or_default() += 1;
                }
                pending = None;
            } else if n >= 3
                || (ins.op0_kind() == OpKind::Register && ins.op0_register() == Register::RDI)
            {
                pending = None;
            } else {
                pending = Some((d, n + 1));
            }
        }
        if ins.mnemonic() == Mnemonic::Mov
            && ins.op0_kind() == OpKind::Register
            && ins.op0_register() == Register::RDI
            && ins.op1_kind() == OpKind::Memory
            && ins.memory_index() == Register::None
            && ins.memory_base() != Register::RIP
            && ins.memory_base() != Register::None
        {
            if let Ok(d) = u32::try_from(ins.memory_displacement64()) {
                if range.contains(&d) {
                    pending = Some((d, 0));
                }
            }
        }
    }
    let mut v: Vec<(u32, u32)> = counts.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let (best, hits) = *v.first()?;
    let second = v.get(1).map_or(0, |x| x.1);
    (hits >= min_hits && hits > 2 * second).then_some((best, hits))
}

/// `VirtIOBlockReq.dev` and `.vq` from `virtio_blk_handle_vq(s, vq)`: after
/// `virtqueue_pop`, virtio_blk_init_request stores `s` and `vq` into the new
/// request (`mov %r12,0x40(%rax); mov %rbp,0x48(%rax)` in 7.2 to 11.1). A linear
/// sweep tracks the copies of the two arguments in callee-saved registers (calls
/// clobber the others) and takes the first store of each into memory that is
/// not the stack. Returns (dev offset, vq offset).
pub fn req_links_from_handle_vq(code: &[u8]) -> Option<(u32, u32)> {
    let mut regs = [Val::Unknown; 16];
    regs[reg_index(Register::RDI)?] = Val::Arg(0);
    regs[reg_index(Register::RSI)?] = Val::Arg(1);
    let caller_saved = [
        Register::RAX,
        Register::RCX,
        Register::RDX,
        Register::RSI,
        Register::RDI,
        Register::R8,
        Register::R9,
        Register::R10,
        Register::R11,
    ];
    let (mut dev, mut vq) = (None, None);
    let mut dec = Decoder::with_ip(64, code, 0, DecoderOptions::NONE);
    let mut ins = Instruction::default();
    for _ in 0..400 {
        if !dec.can_decode() {
            break;
        }
        dec.decode_out(&mut ins);
        if ins.is_invalid() {
            break;
        }
        match ins.mnemonic() {
            Mnemonic::Call => {
                for r in caller_saved {
                    regs[reg_index(r)?] = Val::Unknown;
                }
            }
            Mnemonic::Mov if ins.op0_kind() == OpKind::Register => {
                let v = match ins.op1_kind() {
                    OpKind::Register => regs[reg_index(ins.op1_register())?],
                    _ => Val::Unknown,
                };
                if let Some(i) = reg_index(ins.op0_register()) {
                    regs[i] = v;
                }
            }
            Mnemonic::Mov
                if ins.op0_kind() == OpKind::Memory && ins.op1_kind() == OpKind::Register =>
            {
                let base = ins.memory_base();
                let on_stack = matches!(base, Register::RSP | Register::RIP | Register::None);
                let base_is_arg = reg_index(base).is_some_and(|i| matches!(regs[i], Val::Arg(_)));
                let src = reg_index(ins.op1_register()).map(|i| regs[i]);
                let disp = u32::try_from(ins.memory_displacement64()).ok();
                if !on_stack && !base_is_arg && ins.memory_index() == Register::None {
                    match (src, disp) {
                        (Some(Val::Arg(0)), Some(d)) if dev.is_none() => dev = Some(d),
                        (Some(Val::Arg(1)), Some(d)) if vq.is_none() => vq = Some(d),
                        _ => {}
                    }
                }
            }
            Mnemonic::Ret => break,
            _ => {
                // Any other write to a register forgets what it held.
                if ins.op0_kind() == OpKind::Register {
                    if let Some(i) = reg_index(ins.op0_register()) {
                        if !matches!(
                            ins.mnemonic(),
                            Mnemonic::Test | Mnemonic::Cmp | Mnemonic::Push
                        ) {
                            regs[i] = Val::Unknown;
                        }
                    }
                }
            }
        }
        if let (Some(d), Some(v)) = (dev, vq) {
            return Some((d, v));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    // Byte sequences copied from the .dynsym functions of Debian's
    // qemu-system-x86 builds (object crate / objdump over the extracted debs).

    // QEMU 7.2.22, Debian 12 (bookworm), the host's /usr/bin/qemu-system-x86_64.
    const Q7_2_QUEUE_INDEX: &[u8] = &[0x0f, 0xb7, 0x47, 0x48, 0xc3];
    const Q7_2_GUEST_NOTIFIER: &[u8] = &[0x48, 0x8d, 0x47, 0x68, 0xc3];
    const Q7_2_HOST_NOTIFIER: &[u8] = &[0x48, 0x8d, 0x47, 0x74, 0xc3];
    const Q7_2_BLK_NAME: &[u8] = &[
        0x48, 0x8b, 0x07, 0x48, 0x8d, 0x15, 0xa7, 0x24, 0x29, 0x00, 0x48, 0x85, 0xc0, 0x48, 0x0f,
        0x44, 0xc2, 0xc3,
    ];
    // QEMU 10.0.2, bookworm-backports (1:10.0.2+ds-2+deb13u1~bpo12+1): zeroing
    // of call-used registers before ret.
    const Q10_0_2_QUEUE_INDEX: &[u8] = &[0x0f, 0xb7, 0x47, 0x48, 0x31, 0xff, 0xc3];
    const Q10_0_2_GUEST_NOTIFIER: &[u8] = &[0x48, 0x8d, 0x47, 0x68, 0x31, 0xff, 0xc3];
    const Q10_0_2_HOST_NOTIFIER: &[u8] = &[0x48, 0x8d, 0x47, 0x74, 0x31, 0xff, 0xc3];
    const Q10_0_2_CONFIG_NOTIFIER: &[u8] =
        &[0x48, 0x8d, 0x87, 0xf0, 0x01, 0x00, 0x00, 0x31, 0xff, 0xc3];
    const Q10_0_2_BLK_NAME: &[u8] = &[
        0x48, 0x8b, 0x07, 0x48, 0x8d, 0x15, 0x17, 0x1e, 0x30, 0x00, 0x48, 0x85, 0xc0, 0x48, 0x0f,
        0x44, 0xc2, 0x31, 0xd2, 0x31, 0xff, 0xc3,
    ];
    // QEMU 10.0.13, Debian 13 (trixie, 1:10.0.13+ds-0+deb13u1): endbr64 too.
    const Q10_0_13_QUEUE_INDEX: &[u8] = &[
        0xf3, 0x0f, 0x1e, 0xfa, 0x0f, 0xb7, 0x47, 0x48, 0x31, 0xff, 0xc3,
    ];
    const Q10_0_13_GUEST_NOTIFIER: &[u8] = &[
        0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x8d, 0x47, 0x68, 0x31, 0xff, 0xc3,
    ];
    const Q10_0_13_HOST_NOTIFIER: &[u8] = &[
        0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x8d, 0x47, 0x74, 0x31, 0xff, 0xc3,
    ];
    const Q10_0_13_CONFIG_NOTIFIER: &[u8] = &[
        0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x8d, 0x87, 0xf0, 0x01, 0x00, 0x00, 0x31, 0xff, 0xc3,
    ];
    const Q10_0_13_BLK_NAME: &[u8] = &[
        0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x8b, 0x07, 0x48, 0x8d, 0x15, 0x70, 0x98, 0x19, 0x00, 0x48,
        0x85, 0xc0, 0x48, 0x0f, 0x44, 0xc2, 0x31, 0xd2, 0x31, 0xff, 0xc3,
    ];
    // QEMU 11.1.3, sid (1:11.1.3+ds-1).
    const Q11_1_3_QUEUE_INDEX: &[u8] = &[
        0xf3, 0x0f, 0x1e, 0xfa, 0x0f, 0xb7, 0x47, 0x48, 0x31, 0xff, 0xc3,
    ];
    const Q11_1_3_GUEST_NOTIFIER: &[u8] = &[
        0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x8d, 0x47, 0x68, 0x31, 0xff, 0xc3,
    ];
    const Q11_1_3_HOST_NOTIFIER: &[u8] = &[
        0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x8d, 0x47, 0x74, 0x31, 0xff, 0xc3,
    ];
    const Q11_1_3_CONFIG_NOTIFIER: &[u8] = &[
        0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x8d, 0x87, 0x08, 0x02, 0x00, 0x00, 0x31, 0xff, 0xc3,
    ];
    const Q11_1_3_BLK_NAME: &[u8] = &[
        0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x8b, 0x07, 0x48, 0x8d, 0x15, 0x67, 0xae, 0x1a, 0x00, 0x48,
        0x85, 0xc0, 0x48, 0x0f, 0x44, 0xc2, 0x31, 0xd2, 0x31, 0xff, 0xc3,
    ];

    fn load(off: u32, size: u8) -> Option<Returns> {
        Some(Returns::Load { off, size })
    }

    #[test]
    fn queue_index_in_every_build() {
        for c in [
            Q7_2_QUEUE_INDEX,
            Q10_0_2_QUEUE_INDEX,
            Q10_0_13_QUEUE_INDEX,
            Q11_1_3_QUEUE_INDEX,
        ] {
            assert_eq!(accessor_returns(c), load(0x48, 2), "{c:02x?}");
        }
    }

    #[test]
    fn notifiers_in_every_build() {
        for (g, h) in [
            (Q7_2_GUEST_NOTIFIER, Q7_2_HOST_NOTIFIER),
            (Q10_0_2_GUEST_NOTIFIER, Q10_0_2_HOST_NOTIFIER),
            (Q10_0_13_GUEST_NOTIFIER, Q10_0_13_HOST_NOTIFIER),
            (Q11_1_3_GUEST_NOTIFIER, Q11_1_3_HOST_NOTIFIER),
        ] {
            assert_eq!(accessor_returns(g), Some(Returns::Addr(0x68)));
            assert_eq!(accessor_returns(h), Some(Returns::Addr(0x74)));
        }
    }

    #[test]
    fn config_notifier_moves_between_10_0_and_11_1() {
        assert_eq!(
            accessor_returns(Q10_0_2_CONFIG_NOTIFIER),
            Some(Returns::Addr(0x1f0))
        );
        assert_eq!(
            accessor_returns(Q10_0_13_CONFIG_NOTIFIER),
            Some(Returns::Addr(0x1f0))
        );
        assert_eq!(
            accessor_returns(Q11_1_3_CONFIG_NOTIFIER),
            Some(Returns::Addr(0x208))
        );
    }

    #[test]
    fn blk_name_with_default_for_null() {
        for c in [
            Q7_2_BLK_NAME,
            Q10_0_2_BLK_NAME,
            Q10_0_13_BLK_NAME,
            Q11_1_3_BLK_NAME,
        ] {
            assert_eq!(accessor_returns(c), load(0, 8), "{c:02x?}");
        }
    }

    #[test]
    fn not_an_accessor() {
        // push %rbp; mov %rsp,%rbp; call rel32; …
        assert_eq!(
            accessor_returns(&[0x55, 0x48, 0x89, 0xe5, 0xe8, 0, 0, 0, 0, 0xc3]),
            None
        );
        // A store before ret: `mov %eax,0x48(%rdi); ret`.
        assert_eq!(accessor_returns(&[0x89, 0x47, 0x48, 0xc3]), None);
        // Returns a register that was cleared: `xor eax,eax; ret`.
        assert_eq!(accessor_returns(&[0x31, 0xc0, 0xc3]), None);
        // A RIP-relative address is not a field of the argument.
        assert_eq!(
            accessor_returns(&[0x48, 0x8d, 0x05, 0x10, 0, 0, 0, 0xc3]),
            None
        );
        // Truncated: no ret.
        assert_eq!(accessor_returns(&[0x48, 0x8d, 0x47, 0x68]), None);
        assert_eq!(accessor_returns(&[]), None);
    }

    /// From QEMU 11.1.3 (sid), hw/block/virtio-blk.c (static functions between
    /// virtio_blk_req_complete and virtio_blk_handle_vq): `mov 0x228(%r12),%rdi`
    /// then a call to blk_*; here three such sites with the calls re-targeted.
    #[test]
    fn blk_field_from_its_users() {
        let base = 0x1000u64;
        let blk_fn = 0x9000u64;
        let mut code = Vec::new();
        let call = |code: &mut Vec<u8>, target: u64| {
            let next = base + code.len() as u64 + 5;
            code.push(0xe8);
            code.extend_from_slice(&((target as i64 - next as i64) as i32).to_le_bytes());
        };
        for _ in 0..3 {
            code.extend_from_slice(&[0x49, 0x8b, 0xbc, 0x24, 0x28, 0x02, 0x00, 0x00]); // mov 0x228(%r12),%rdi
            code.extend_from_slice(&[0x31, 0xf6]); // xor %esi,%esi
            call(&mut code, blk_fn);
        }
        // A load not followed by a blk_* call, and one of another offset.
        code.extend_from_slice(&[0x48, 0x8b, 0xbb, 0x40, 0x02, 0x00, 0x00]); // mov 0x240(%rbx),%rdi
        call(&mut code, 0x7000);
        code.push(0xc3);
        let f = |t: u64| t == blk_fn;
        assert_eq!(
            blk_field_from_calls(&code, base, f, 0x180..0x400, 3),
            Some((0x228, 3))
        );
        assert_eq!(blk_field_from_calls(&code, base, f, 0x180..0x400, 4), None);
        assert_eq!(blk_field_from_calls(&code, base, f, 0x300..0x400, 1), None);
    }

    // virtio_blk_handle_vq of QEMU 11.1.3 (sid), its first 0x6a bytes: endbr64,
    // the argument copies (r12 = s, rbp = vq), memset and two calls, then the
    // loop body that fills the popped request.
    const Q11_1_3_HANDLE_VQ: &[u8] = &[
        0xf3, 0x0f, 0x1e, 0xfa, 0x41, 0x55, 0xba, 0x08, 0x01, 0x00, 0x00, 0x41, 0x54, 0x49, 0x89,
        0xfc, 0x55, 0x53, 0x48, 0x81, 0xec, 0x18, 0x01, 0x00, 0x00, 0x64, 0x48, 0x8b, 0x2c, 0x25,
        0x28, 0x00, 0x00, 0x00, 0x48, 0x89, 0xac, 0x24, 0x08, 0x01, 0x00, 0x00, 0x48, 0x89, 0xf5,
        0x48, 0x89, 0xe7, 0x31, 0xf6, 0xe8, 0x29, 0x8f, 0xe4, 0xff, 0x48, 0x89, 0xef, 0xe8, 0x91,
        0x83, 0x1d, 0x00, 0x41, 0x89, 0xc5, 0xe8, 0x19, 0x67, 0x4e, 0x00, 0x45, 0x84, 0xed, 0x74,
        0x39, 0xe9, 0xb0, 0x00, 0x00, 0x00, 0x0f, 0x1f, 0x80, 0x00, 0x00, 0x00, 0x00, 0x4c, 0x89,
        0x60, 0x40, 0x66, 0x0f, 0xef, 0xc0, 0x48, 0x89, 0xe6, 0x48, 0x89, 0xc7, 0x48, 0x89, 0x68,
        0x48,
    ];

    #[test]
    fn request_links_from_handle_vq() {
        assert_eq!(
            req_links_from_handle_vq(Q11_1_3_HANDLE_VQ),
            Some((0x40, 0x48))
        );
        // Stores of the arguments onto the stack only: no answer.
        // mov %rdi,%r12; mov %rsi,%rbp; mov %r12,0x8(%rsp); mov %rbp,0x10(%rsp); ret
        let stack_only = [
            0x49, 0x89, 0xfc, 0x48, 0x89, 0xf5, 0x4c, 0x89, 0x64, 0x24, 0x08, 0x48, 0x89, 0x6c,
            0x24, 0x10, 0xc3,
        ];
        assert_eq!(req_links_from_handle_vq(&stack_only), None);
        // A call clobbers rsi: a later store of rsi is not the vq.
        // mov %rdi,%r12; call +0; mov %r12,0x40(%rax); mov %rsi,0x48(%rax); ret
        let clobbered = [
            0x49, 0x89, 0xfc, 0xe8, 0, 0, 0, 0, 0x4c, 0x89, 0x60, 0x40, 0x48, 0x89, 0x70, 0x48,
            0xc3,
        ];
        assert_eq!(req_links_from_handle_vq(&clobbered), None);
    }

    #[test]
    fn other_register_moves_and_adds() {
        // mov %rdi,%rax; add $0x74,%rax; ret
        assert_eq!(
            accessor_returns(&[0x48, 0x89, 0xf8, 0x48, 0x83, 0xc0, 0x74, 0xc3]),
            Some(Returns::Addr(0x74))
        );
        // movzwl 0x148(%rdi),%eax; ret (disp32 form)
        assert_eq!(
            accessor_returns(&[0x0f, 0xb7, 0x87, 0x48, 0x01, 0, 0, 0xc3]),
            load(0x148, 2)
        );
    }
}

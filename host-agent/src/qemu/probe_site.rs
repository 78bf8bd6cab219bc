//! Where in a probe target its uprobe goes: on the first instruction the kernel
//! emulates, if one comes early enough that the probe still sees what it would
//! see at the entry.
//!
//! A uprobe's trap either emulates the probed instruction (x86: a short or near
//! `jcc`/`jmp`, a one-byte `nop`, `push r64`) or runs a copy of it out of line
//! with a single-step, a second trap per hit. On this project's nested x86 host
//! a hit costs 18 µs single-stepped against 0.48 µs emulated (a `sub
//! $8,%rsp` against a `push %r9` or a `js`, the same BPF program; docs/
//! PERFORMANCE.md). QEMU's `blk_aio_*` start with `sub $8,%rsp` and
//! `virtqueue_pop` with a `movabs`, so `--submit` and `--pop` single-stepped at
//! every request.
//!
//! The site is the first instruction that the kernel emulates among those the
//! entry reaches without a branch, when every instruction before it:
//! - falls through (no branch, call, return or trap);
//! - leaves each argument its program reads ([`Needs::reads`]) in a register:
//!   its own (SysV order), or, for a program that reads its arguments where the
//!   attach cookie says ([`Needs::follows`]), one a `mov` copied it to before its
//!   own was overwritten ([`Site::moved`]);
//! - writes no memory except by a `push` (below the entry's stack: no argument's
//!   pointee), and, where a return probe shares the site, neither the stack
//!   pointer nor memory at all (the kernel takes the return address from the top
//!   of the stack).
//!
//! and no branch lands between the entry and the site: none in the function
//! (decoded whole, from its symbol's size; an indirect jump counts as one) and
//! no `call`/`jmp`/`jcc rel32` anywhere in the binary's code (a byte scan,
//! [`interior_refs`]; a false match only keeps the entry). Otherwise the entry,
//! past an `endbr64` (it writes nothing).

use iced_x86::{Decoder, DecoderOptions, FlowControl, InstructionInfoFactory, Mnemonic, OpAccess};
use iced_x86::{Instruction, OpKind, Register};
use std::collections::HashMap;

/// What a probe needs to find at its site.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Needs {
    /// The arguments its program reads, a bit per SysV position (bit 0: rdi,
    /// 1: rsi, 2: rdx, 3: rcx, 4: r8, 5: r9).
    pub reads: u8,
    /// A return probe shares the site.
    pub ret: bool,
    /// Its program reads an argument from the register the attach cookie names
    /// ([`Site::cookie`]) when not from its own.
    pub follows: bool,
}

impl Needs {
    /// A uprobe only, whose program reads the arguments of mask `reads`.
    pub const fn reads(reads: u8) -> Needs {
        Needs {
            reads,
            ret: false,
            follows: false,
        }
    }
    /// The same, and a uretprobe on the same site.
    pub const fn with_ret(self) -> Needs {
        Needs { ret: true, ..self }
    }
    /// The same, its program following moved arguments (the attach cookie).
    pub const fn following(self) -> Needs {
        Needs {
            follows: true,
            ..self
        }
    }
}

const ARG_REGS: [Register; 6] = [
    Register::RDI,
    Register::RSI,
    Register::RDX,
    Register::RCX,
    Register::R8,
    Register::R9,
];

/// The registers an attach cookie can name for a moved argument: code `i + 1`
/// is `MOVE_REGS[i]` (the BPF side's `site_arg`, bpf/host/host_qemu.h, reads
/// the same order from `struct pt_regs`).
pub const MOVE_REGS: [Register; 15] = [
    Register::RAX,
    Register::RBX,
    Register::RCX,
    Register::RDX,
    Register::RSI,
    Register::RDI,
    Register::RBP,
    Register::R8,
    Register::R9,
    Register::R10,
    Register::R11,
    Register::R12,
    Register::R13,
    Register::R14,
    Register::R15,
];

/// `endbr64`, the first instruction of every function in CET builds.
const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];

/// Bytes from the entry within which a site is looked for.
pub const SCAN_BYTES: usize = 64;

/// A probe's place in its function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Site {
    /// Bytes past the entry.
    pub offset: u64,
    /// The probed instruction's mnemonic (`push`, `js`, `sub`).
    pub insn: String,
    /// The kernel emulates it: no single-step per hit.
    pub emulated: bool,
    /// The arguments (SysV position) that are in another register there than
    /// at the entry, and that register (one of [`MOVE_REGS`]).
    pub moved: Vec<(u8, Register)>,
}

impl Site {
    /// The attach cookie of its uprobe: 4 bits per argument position, the
    /// code of the register it was moved to ([`MOVE_REGS`]), 0 where it was not.
    pub fn cookie(&self) -> u64 {
        self.moved
            .iter()
            .filter_map(|&(arg, reg)| {
                let code = MOVE_REGS.iter().position(|r| *r == reg)? as u64 + 1;
                Some(code << (4 * u64::from(arg)))
            })
            .sum()
    }
}

/// Whether Linux's x86-64 uprobes emulate the instruction of bytes `b` in the
/// trap (arch/x86/kernel/uprobes.c: `branch_setup_xol_ops`, all kernels;
/// `push_setup_xol_ops`, 4.15+, `push r64` with no prefix but REX.B). `call`
/// is emulated too but left out: with a user shadow stack its emulation
/// depends on the kernel. A 0x66 prefix is refused by the kernel, and others
/// are not accepted here.
pub fn kernel_emulates(b: &[u8]) -> bool {
    matches!(
        b,
        [0x90]
            | [0x50..=0x57]
            | [0x41, 0x50..=0x57]
            | [0x70..=0x7f, _]
            | [0xeb, _]
            | [0xe9, _, _, _, _]
            | [0x0f, 0x80..=0x8f, _, _, _, _]
    )
}

fn mnemonic(i: &Instruction) -> String {
    format!("{:?}", i.mnemonic()).to_lowercase()
}

fn writes(a: OpAccess) -> bool {
    matches!(
        a,
        OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite
    )
}

/// Whether `i`, run before the site, leaves the memory and the stack the
/// probe needs as at entry (its registers: [`Holders`]).
fn harmless(i: &Instruction, info: &mut InstructionInfoFactory, needs: Needs) -> bool {
    if i.flow_control() != FlowControl::Next {
        return false;
    }
    let info = info.info(i);
    let rsp_ok = !needs.ret
        || info
            .used_registers()
            .iter()
            .all(|u| !writes(u.access()) || u.register().full_register() != Register::RSP);
    let mem_ok = info
        .used_memory()
        .iter()
        .all(|m| !writes(m.access()) || (!needs.ret && i.mnemonic() == Mnemonic::Push));
    rsp_ok && mem_ok
}

/// Which argument's entry value each register holds, as the prologue runs.
struct Holders(HashMap<Register, u8>);

impl Holders {
    fn at_entry() -> Holders {
        Holders((0u8..).zip(ARG_REGS).map(|(a, r)| (r, a)).collect())
    }

    /// After `i` (harmless, so it falls through): a 64-bit register-to-register
    /// `mov` copies what its source holds; any other write of a register
    /// (whole or part) leaves it holding no argument.
    fn step(&mut self, i: &Instruction, info: &mut InstructionInfoFactory) {
        let gpr64 = |r: Register| r.is_gpr64();
        if i.mnemonic() == Mnemonic::Mov
            && i.op_count() == 2
            && i.op0_kind() == OpKind::Register
            && i.op1_kind() == OpKind::Register
            && gpr64(i.op0_register())
            && gpr64(i.op1_register())
        {
            match self.0.get(&i.op1_register()).copied() {
                Some(a) => self.0.insert(i.op0_register(), a),
                None => self.0.remove(&i.op0_register()),
            };
            return;
        }
        for u in info.info(i).used_registers() {
            if writes(u.access()) {
                self.0.remove(&u.register().full_register());
            }
        }
    }

    /// Where the arguments `needs` reads are: `Some(moved)` when each is in
    /// its own register or (a program that follows) in another one.
    fn place(&self, needs: Needs) -> Option<Vec<(u8, Register)>> {
        let mut moved = Vec::new();
        for (a, own) in (0u8..).zip(ARG_REGS) {
            if needs.reads & (1 << a) == 0 || self.0.get(&own) == Some(&a) {
                continue;
            }
            if !needs.follows {
                return None;
            }
            let r = MOVE_REGS.iter().find(|r| self.0.get(r) == Some(&a))?;
            moved.push((a, *r));
        }
        Some(moved)
    }
}

/// The instructions of `code` (at `entry`) with their offsets, past a leading
/// `endbr64` (it writes no register, flag or memory: a probe past it reads what
/// it would read at the entry, and a return probe there still finds the return
/// address on top of the stack), up to the first byte that does not decode.
fn prologue(code: &[u8], entry: u64) -> impl Iterator<Item = (usize, Instruction)> + '_ {
    let mut dec = Decoder::with_ip(64, code, entry, DecoderOptions::NONE);
    let mut off = 0usize;
    std::iter::from_fn(move || {
        if !dec.can_decode() {
            return None;
        }
        let insn = dec.decode();
        let at = off;
        off += insn.len();
        (!insn.is_invalid()).then_some((at, insn))
    })
    .skip_while(|(at, insn)| *at == 0 && insn.mnemonic() == Mnemonic::Endbr64)
}

/// The probe site of instruction `insn` at `off` in `code`.
fn site_at(code: &[u8], off: usize, insn: &Instruction) -> Site {
    Site {
        offset: off as u64,
        insn: mnemonic(insn),
        emulated: kernel_emulates(&code[off..off + insn.len()]),
        moved: Vec::new(),
    }
}

/// The entry's site: its first instruction past an `endbr64`.
pub fn entry_site(code: &[u8], entry: u64) -> Site {
    let endbr = if code.starts_with(&ENDBR64) {
        ENDBR64.len()
    } else {
        0
    };
    prologue(code, entry).next().map_or(
        Site {
            offset: endbr as u64,
            insn: String::new(),
            emulated: false,
            moved: Vec::new(),
        },
        |(off, i)| site_at(code, off, &i),
    )
}

/// The site in a function whose first bytes are `code` (at address `entry`):
/// the first instruction the kernel emulates (see the module's conditions),
/// else the entry past an `endbr64`. The branches into the skipped bytes are
/// checked by the caller ([`branches_into`], [`interior_refs`]).
pub fn site_in(code: &[u8], entry: u64, needs: Needs) -> Site {
    let code = &code[..code.len().min(SCAN_BYTES)];
    let mut factory = InstructionInfoFactory::new();
    let mut holders = Holders::at_entry();
    let mut first = None;
    for (off, insn) in prologue(code, entry) {
        let mut here = site_at(code, off, &insn);
        // (where the arguments are before this instruction runs: one lost
        // from every register stays lost)
        let Some(moved) = holders.place(needs) else {
            break;
        };
        if here.emulated {
            here.moved = moved;
            return here;
        }
        first.get_or_insert(here);
        if !harmless(&insn, &mut factory, needs) {
            break;
        }
        holders.step(&insn, &mut factory);
    }
    first.unwrap_or_else(|| entry_site(code, entry))
}

/// Whether a branch of the function `code` (at `entry`, whole) may land in
/// `(entry + lo, entry + hi]`: a direct one whose target is there, or any
/// indirect jump (its targets are unknown).
pub fn branches_into(code: &[u8], entry: u64, lo: u64, hi: u64) -> bool {
    let mut dec = Decoder::with_ip(64, code, entry, DecoderOptions::NONE);
    let mut insn = Instruction::default();
    while dec.can_decode() {
        dec.decode_out(&mut insn);
        match insn.flow_control() {
            FlowControl::IndirectBranch => return true,
            FlowControl::UnconditionalBranch
            | FlowControl::ConditionalBranch
            | FlowControl::Call => {
                let t = insn.near_branch_target();
                if t > entry + lo && t <= entry + hi {
                    return true;
                }
            }
            _ => {}
        }
    }
    false
}

/// The target of a `rel32` operand of `code` (at `base`) whose displacement is at
/// `disp_at` and whose instruction ends at `end`: `base + end + disp`.
pub fn rel32_target(code: &[u8], base: u64, disp_at: usize, end: usize) -> Option<u64> {
    let d = i32::from_le_bytes(code.get(disp_at..disp_at + 4)?.try_into().ok()?);
    Some((base as i64 + end as i64 + i64::from(d)) as u64)
}

/// The functions of `ranges` (name → `(lo, hi]` as addresses) that a `call`,
/// `jmp` or `jcc` with a 32-bit displacement in `code` (at `base`, instructions
/// starting in its first `starts` bytes) reaches. A byte scan, like
/// `count_code_refs`: a false match keeps the entry, never misplaces a probe.
pub fn interior_refs<'a>(
    code: &[u8],
    base: u64,
    starts: usize,
    ranges: &HashMap<&'a str, (u64, u64)>,
) -> Vec<&'a str> {
    let mut out = Vec::new();
    if ranges.is_empty() {
        return out;
    }
    for i in 0..starts.min(code.len()) {
        let t = match code[i] {
            0xe8 | 0xe9 => rel32_target(code, base, i + 1, i + 5),
            0x0f if code.get(i + 1).is_some_and(|b| (0x80..=0x8f).contains(b)) => {
                rel32_target(code, base, i + 2, i + 6)
            }
            _ => None,
        };
        let Some(t) = t else { continue };
        for (name, (lo, hi)) in ranges {
            if t > *lo && t <= *hi && !out.contains(name) {
                out.push(*name);
            }
        }
    }
    out
}

#[cfg(test)]
#[path = "probe_site_tests.rs"]
mod tests;

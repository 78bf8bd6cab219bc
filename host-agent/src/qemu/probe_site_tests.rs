use super::*;
use crate::qemu::binary::PROBE_SYMBOLS;

const E: u64 = 0x1000;
/// All six argument registers, and a return probe: the strictest needs.
const UNKNOWN_NEEDS: Needs = Needs::reads(0b11_1111).with_ret();

fn needs_of(sym: &str) -> Needs {
    PROBE_SYMBOLS
        .iter()
        .find(|p| p.0 == sym)
        .map(|p| p.3)
        .unwrap()
}

fn site(code: &[u8], sym: &str) -> (u64, String, bool) {
    let s = site_in(code, E, needs_of(sym));
    assert!(s.moved.is_empty() || needs_of(sym).follows, "{sym}: {s:?}");
    (s.offset, s.insn, s.emulated)
}

// The first bytes of the probe targets in three builds (objdump of Debian's
// qemu-system-x86 7.2.22 (bookworm), 10.0 (bookworm-backports), 11.x (sid, CET)).
const PREADV_7_2: &[u8] = &[
    0x48, 0x83, 0xec, 0x08, // sub $0x8,%rsp
    0x48, 0x8b, 0x42, 0x20, // mov 0x20(%rdx),%rax
    0x48, 0x85, 0xc0, // test %rax,%rax
    0x78, 0x1e, // js +0x2b
    0x41, 0x51, // push %r9
    0x41, 0x89, 0xc9, 0x48, 0x89, 0xd1, 0x48, 0x89, 0xc2, 0x41, 0x50, 0x4c, 0x8d, 0x05, 0x3f, 0x0d,
    0x00, 0x00, 0xe8, 0xea, 0xe9, 0xff, 0xff,
];
const PREADV_SID: &[u8] = &[
    0xf3, 0x0f, 0x1e, 0xfa, // endbr64
    0x48, 0x83, 0xec, 0x08, // sub $0x8,%rsp
    0x48, 0x89, 0xd0, // mov %rdx,%rax
    0x48, 0x8b, 0x52, 0x20, // mov 0x20(%rdx),%rdx: the third argument replaced
    0x48, 0x85, 0xd2, // test %rdx,%rdx
    0x0f, 0x88, 0x96, 0x06, 0xac, 0xff, // js rel32
    0x41, 0x51,
];
const FLUSH_7_2: &[u8] = &[
    0x48, 0x83, 0xec, 0x08, // sub $0x8,%rsp
    0x45, 0x31, 0xc9, // xor %r9d,%r9d (not an argument of a 3-argument function)
    0x4c, 0x8d, 0x05, 0x72, 0x08, 0x00, 0x00, // lea ...(%rip),%r8
    0x31, 0xc9, // xor %ecx,%ecx
    0x52, // push %rdx
    0x31, 0xd2, 0x56, 0x31, 0xf6, 0xe8, 0xc5, 0xe8, 0xff, 0xff, 0x48, 0x83, 0xc4, 0x18, 0xc3,
];
const PDISCARD_7_2: &[u8] = &[
    0x48, 0x83, 0xec, 0x08, 0x45, 0x31, 0xc9, // sub; xor %r9d,%r9d (5 arguments)
    0x41, 0x50, // push %r8
    0x4c, 0x8d, 0x05, 0x80, 0x10, 0x00, 0x00, 0x51, 0x31, 0xc9, 0xe8, 0xe8, 0xe8, 0xff, 0xff,
];
const WZEROES_7_2: &[u8] = &[
    0x48, 0x83, 0xec, 0x08, // sub $0x8,%rsp
    0x83, 0xc9, 0x02, // or $0x2,%ecx: the fourth argument (flags, not read) changed
    0x41, 0x51, // push %r9
    0x41, 0x89, 0xc9, 0x31, 0xc9, 0x41, 0x50,
];
const POP_7_2: &[u8] = &[
    0x48, 0xb8, 0x00, 0x00, 0x00, 0xff, 0x00, 0xff, 0x00, 0x00, // movabs $..,%rax
    0x48, 0x8b, 0x57, 0x60, // mov 0x60(%rdi),%rdx (not an argument of a 2-argument function)
    0x48, 0x23, 0x82, 0xb0, 0x01, 0x00, 0x00, // and 0x1b0(%rdx),%rax
    0x75, 0x19, // jne +0x30
    0xf6, 0x82, 0xb4, 0x00, 0x00, 0x00, 0x04, 0x74, 0x08, 0xe9, 0xdb, 0xf1, 0xff, 0xff,
];
const POP_SID: &[u8] = &[
    0xf3, 0x0f, 0x1e, 0xfa, // endbr64
    0x48, 0x8b, 0x47, 0x60, // mov 0x60(%rdi),%rax
    0x80, 0xb8, 0xc5, 0x01, 0x00, 0x00, 0x00, // cmpb $0x0,0x1c5(%rax)
    0x75, 0x27, // jne
    0x80, 0xb8, 0xc3, 0x01, 0x00, 0x00, 0x00, 0x75, 0x1e,
];

#[test]
fn the_site_is_the_first_emulated_instruction_that_sees_the_entrys_arguments() {
    // --submit on 7.2 and 10.0: the js after the size check, not the sub.
    assert_eq!(site(PREADV_7_2, "blk_aio_preadv"), (0xb, "js".into(), true));
    // sid reloads %rdx (the QEMUIOVector) before its branch, after copying it
    // to %rax: the js, the vector read from %rax (the cookie's code 1 at
    // argument position 2).
    assert_eq!(
        site(PREADV_SID, "blk_aio_preadv"),
        (0x12, "js".into(), true)
    );
    let s = site_in(PREADV_SID, E, needs_of("blk_aio_preadv"));
    assert_eq!(s.moved, vec![(2, Register::RAX)]);
    assert_eq!(s.cookie(), 1 << 8);
    assert_eq!(
        site(FLUSH_7_2, "blk_aio_flush"),
        (0x10, "push".into(), true)
    );
    assert_eq!(
        site(PDISCARD_7_2, "blk_aio_pdiscard"),
        (7, "push".into(), true)
    );
    // Its flags change first, which its program does not read.
    assert_eq!(
        site(WZEROES_7_2, "blk_aio_pwrite_zeroes"),
        (7, "push".into(), true)
    );
    // --pop: the uretprobe shares the site; nothing before it moves %rsp.
    assert_eq!(site(POP_7_2, "virtqueue_pop"), (0x15, "jne".into(), true));
    assert_eq!(site(POP_SID, "virtqueue_pop"), (0xf, "jne".into(), true));
    // Already emulated at the entry (7.2's virtqueue_push), or past endbr64 (sid).
    assert_eq!(
        site(&[0x41, 0x54, 0x41, 0x89, 0xd4], "virtqueue_push"),
        (0, "push".into(), true)
    );
    assert_eq!(
        site(
            &[0xf3, 0x0f, 0x1e, 0xfa, 0x55, 0x89, 0xd5],
            "virtqueue_push"
        ),
        (4, "push".into(), true)
    );
}

#[test]
fn a_site_never_lies_past_a_change_the_probe_would_see() {
    // A return probe: nothing may move %rsp before it (sub, then jcc).
    let sub_jcc = [0x48, 0x83, 0xec, 0x08, 0x75, 0x02];
    assert_eq!(site_in(&sub_jcc, E, Needs::reads(1).with_ret()).offset, 0);
    assert_eq!(site_in(&sub_jcc, E, Needs::reads(0b1)).offset, 4);
    // A store, even to the stack, ends the search (mov %rdi,(%rsp); push %rbx).
    let store = [0x48, 0x89, 0x3c, 0x24, 0x53];
    assert_eq!(site_in(&store, E, Needs::reads(0b1)).offset, 0);
    // A call, or a branch the kernel does not emulate, ends it as well:
    // call rel32; push; and jmp *%rax; push.
    assert_eq!(
        site_in(&[0xe8, 0, 0, 0, 0, 0x53], E, UNKNOWN_NEEDS).offset,
        0
    );
    assert_eq!(site_in(&[0xff, 0xe0, 0x53], E, UNKNOWN_NEEDS).offset, 0);
    // A partial write of an argument register counts (xor %r9d,%r9d; push %rbx).
    assert_eq!(
        site_in(&[0x45, 0x31, 0xc9, 0x53], E, Needs::reads(0b10_0000)).offset,
        0
    );
    assert_eq!(
        site_in(&[0x45, 0x31, 0xc9, 0x53], E, Needs::reads(0b1_1111)).offset,
        3
    );
    // Nothing emulated within reach: the entry; no bytes at all: the entry.
    assert_eq!(
        site_in(&[0x48, 0x83, 0xec, 0x08], E, UNKNOWN_NEEDS).offset,
        0
    );
    assert_eq!(site_in(&[], E, UNKNOWN_NEEDS).offset, 0);
    assert_eq!(
        site_in(&[0xf3, 0x0f, 0x1e, 0xfa], E, UNKNOWN_NEEDS).offset,
        4
    );
}

#[test]
fn emulated_instructions_are_the_kernels_own_list() {
    for yes in [
        &[0x90][..],
        &[0x53],
        &[0x41, 0x51],
        &[0x78, 0x1e],
        &[0xeb, 0x00],
        &[0xe9, 1, 2, 3, 4],
        &[0x0f, 0x88, 1, 2, 3, 4],
    ] {
        assert!(kernel_emulates(yes), "{yes:x?}");
    }
    for no in [
        &[0x48, 0x83, 0xec, 0x08][..],
        &[0x48, 0x53],       // push with REX.W: not the kernel's form
        &[0x66, 0x90],       // 0x66 prefix: refused by the kernel
        &[0xe8, 1, 2, 3, 4], // call: left out (shadow stacks)
        &[0x0f, 0x1f, 0x00], // multi-byte nop: not on every kernel
        &[0xc3],
    ] {
        assert!(!kernel_emulates(no), "{no:x?}");
    }
}

#[test]
fn branches_into_the_skipped_bytes_are_found() {
    // 7.2's blk_aio_preadv: its js goes to +0x2b, past the site +0xb.
    assert!(!branches_into(PREADV_7_2, E, 0, 0xb));
    // A loop back to +4 (jne -0x0a at +0xc) lands in (0, 0xb].
    let back = [
        0x48, 0x83, 0xec, 0x08, 0x48, 0x85, 0xc0, 0x90, 0x90, 0x90, 0x90, 0x90, 0x75, 0xf6,
    ];
    assert!(branches_into(&back, E, 0, 0xb));
    // ... but not to the entry itself (the lower bound is excluded).
    assert!(!branches_into(&back, E, 4, 0xb));
    // An indirect jump may land anywhere.
    assert!(branches_into(&[0x90, 0xff, 0xe0], E, 0, 1));
}

#[test]
fn rel32_branches_from_elsewhere_into_a_prologue_are_found() {
    let ranges: HashMap<&str, (u64, u64)> = [("f", (0x2000, 0x200b))].into_iter().collect();
    // jmp rel32 at 0x1000 to 0x2004: 0x1005 + 0xfff
    let jmp = [0xe9, 0xff, 0x0f, 0x00, 0x00];
    assert_eq!(interior_refs(&jmp, 0x1000, jmp.len(), &ranges), vec!["f"]);
    // jne rel32 at 0x1000 to 0x200b: 0x1006 + 0x1005
    let jcc = [0x0f, 0x85, 0x05, 0x10, 0x00, 0x00];
    assert_eq!(interior_refs(&jcc, 0x1000, jcc.len(), &ranges), vec!["f"]);
    // A call to the entry itself, and a jump past the site: not inside.
    let call = [0xe8, 0xfb, 0x0f, 0x00, 0x00];
    assert!(interior_refs(&call, 0x1000, call.len(), &ranges).is_empty());
    let past = [0xe9, 0x07, 0x10, 0x00, 0x00];
    assert!(interior_refs(&past, 0x1000, past.len(), &ranges).is_empty());
}

#[test]
fn the_entry_site_is_past_endbr64_and_nowhere_else() {
    // QEMU 11.1 (sid, CET): virtqueue_push starts endbr64; push %rbp.
    let s = entry_site(&[0xf3, 0x0f, 0x1e, 0xfa, 0x55, 0x48], E);
    assert_eq!((s.offset, s.insn.as_str(), s.emulated), (4, "push", true));
    // QEMU 7.2 (bookworm): push %r12, at the entry.
    assert_eq!(entry_site(&[0x41, 0x54, 0x41, 0x89, 0xd4], E).offset, 0);
    // endbr32, a truncated read and nothing: the entry.
    assert_eq!(entry_site(&[0xf3, 0x0f, 0x1e, 0xfb, 0x55], E).offset, 0);
    assert_eq!(entry_site(&[0xf3, 0x0f, 0x1e], E).offset, 0);
    assert_eq!(entry_site(&[], E).offset, 0);
}

#[test]
fn a_moved_argument_is_followed_only_while_a_register_holds_it() {
    let rdx = Needs::reads(0b100);
    // mov %rdx,%rax; mov 0x20(%rdx),%rdx; push %rbx: %rdx's entry value in %rax.
    let copied = [0x48, 0x89, 0xd0, 0x48, 0x8b, 0x52, 0x20, 0x53];
    let s = site_in(&copied, E, rdx.following());
    assert_eq!((s.offset, s.moved.clone()), (7, vec![(2, Register::RAX)]));
    // A program that reads its own registers only: the entry.
    assert_eq!(site_in(&copied, E, rdx).offset, 0);
    // The copy overwritten as well (xor %eax,%eax): lost, the entry.
    let lost = [0x48, 0x89, 0xd0, 0x48, 0x8b, 0x52, 0x20, 0x31, 0xc0, 0x53];
    assert_eq!(site_in(&lost, E, rdx.following()).offset, 0);
    // A 32-bit move copies only part of it: the entry.
    let half = [0x89, 0xd0, 0x48, 0x8b, 0x52, 0x20, 0x53];
    assert_eq!(site_in(&half, E, rdx.following()).offset, 0);
    // Copied on (mov %rdx,%rax; mov %rax,%r12; xor %eax,%eax; xor %edx,%edx;
    // push %rbx): found in %r12, the last register that holds it.
    let chain = [
        0x48, 0x89, 0xd0, 0x49, 0x89, 0xc4, 0x31, 0xc0, 0x31, 0xd2, 0x53,
    ];
    let s = site_in(&chain, E, rdx.following());
    assert_eq!((s.offset, s.moved.clone()), (10, vec![(2, Register::R12)]));
    assert_eq!(s.cookie(), 12 << 8);
    // Unread arguments may change (xor %edi,%edi; push %rbx), read ones not
    // unless followed.
    assert_eq!(site_in(&[0x31, 0xff, 0x53], E, rdx).offset, 2);
    assert_eq!(site_in(&[0x31, 0xd2, 0x53], E, rdx).offset, 0);
    // At the entry nothing has moved: an empty cookie.
    assert_eq!(entry_site(&copied, E).cookie(), 0);
}

#[test]
fn the_cookie_codes_are_the_bpf_sides_register_order() {
    // bpf/host/host_qemu.h's site_arg: 1 ax, 2 bx, 3 cx, 4 dx, 5 si, 6 di,
    // 7 bp, 8..15 r8..r15.
    let site = |moved| Site {
        offset: 1,
        insn: "push".into(),
        emulated: true,
        moved,
    };
    assert_eq!(site(vec![(0, Register::RBP)]).cookie(), 7);
    assert_eq!(site(vec![(5, Register::R15)]).cookie(), 15 << 20);
    assert_eq!(
        site(vec![(2, Register::RBX), (5, Register::R8)]).cookie(),
        (2 << 8) | (8 << 20)
    );
    assert_eq!(MOVE_REGS.len(), 15);
}

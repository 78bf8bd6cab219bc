//! USDT probes (SystemTap SDT notes, `.note.stapsdt`), which QEMU builds with the
//! dtrace trace backend carry (Fedora, RHEL/CentOS Stream; provider `qemu`).
//! Debian and Ubuntu builds have none.

/// One SDT probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsdtProbe {
    pub provider: String,
    pub name: String,
    pub pc: u64,
    /// Address of the probe's semaphore (0: none).
    pub semaphore: u64,
    /// Argument specification (`8@%rdi -4@%eax …`).
    pub args: String,
}

const NT_STAPSDT: u32 = 3;

fn align4(n: usize) -> Option<usize> {
    n.checked_add(3).map(|x| x & !3)
}

fn cstr(b: &[u8]) -> Option<(String, &[u8])> {
    let end = b.iter().position(|&c| c == 0)?;
    let s = std::str::from_utf8(&b[..end]).ok()?.to_string();
    Some((s, &b[end + 1..]))
}

/// Parses the contents of a little-endian 64-bit `.note.stapsdt` section.
/// Malformed notes end the walk (what was parsed before is kept).
pub fn parse_stapsdt(mut d: &[u8]) -> Vec<UsdtProbe> {
    let mut out = Vec::new();
    let u32_at = |b: &[u8], o: usize| -> Option<u32> {
        Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?))
    };
    while d.len() >= 12 {
        let (Some(namesz), Some(descsz), Some(ty)) = (u32_at(d, 0), u32_at(d, 4), u32_at(d, 8))
        else {
            break;
        };
        let (namesz, descsz) = (namesz as usize, descsz as usize);
        let Some(name_end) = align4(namesz).and_then(|n| n.checked_add(12)) else {
            break;
        };
        let Some(desc_end) = align4(descsz).and_then(|n| n.checked_add(name_end)) else {
            break;
        };
        let (Some(owner), Some(desc)) =
            (d.get(12..12 + namesz), d.get(name_end..name_end + descsz))
        else {
            break;
        };
        if ty == NT_STAPSDT && owner == b"stapsdt\0" && desc.len() >= 24 {
            let u64_at = |o: usize| u64::from_le_bytes(desc[o..o + 8].try_into().unwrap_or([0; 8]));
            let (pc, semaphore) = (u64_at(0), u64_at(16));
            let parsed = cstr(&desc[24..]).and_then(|(provider, rest)| {
                let (name, rest) = cstr(rest)?;
                let (args, _) = cstr(rest).unwrap_or_default();
                Some((provider, name, args))
            });
            if let Some((provider, name, args)) = parsed {
                out.push(UsdtProbe {
                    provider,
                    name,
                    pc,
                    semaphore,
                    args,
                });
            }
        }
        d = d.get(desc_end.min(d.len())..).unwrap_or_default();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One note as `gcc`'s sys/sdt.h emits it.
    fn note(provider: &str, name: &str, args: &str, pc: u64, sem: u64) -> Vec<u8> {
        let mut desc = Vec::new();
        desc.extend_from_slice(&pc.to_le_bytes());
        desc.extend_from_slice(&0x1000u64.to_le_bytes()); // .stapsdt.base
        desc.extend_from_slice(&sem.to_le_bytes());
        for s in [provider, name, args] {
            desc.extend_from_slice(s.as_bytes());
            desc.push(0);
        }
        let mut n = Vec::new();
        n.extend_from_slice(&8u32.to_le_bytes());
        n.extend_from_slice(&(desc.len() as u32).to_le_bytes());
        n.extend_from_slice(&NT_STAPSDT.to_le_bytes());
        n.extend_from_slice(b"stapsdt\0");
        n.extend_from_slice(&desc);
        while n.len() % 4 != 0 {
            n.push(0);
        }
        n
    }

    #[test]
    fn parses_qemu_probes() {
        let mut sec = note(
            "qemu",
            "virtqueue_pop",
            "8@%rbx 8@%rax -4@%edx -4@%ecx",
            0x4a1230,
            0x1b2c3e,
        );
        sec.extend(note("qemu", "virtio_notify", "8@%rdi 8@%rsi", 0x4a2000, 0));
        let p = parse_stapsdt(&sec);
        assert_eq!(p.len(), 2);
        assert_eq!(
            p[0],
            UsdtProbe {
                provider: "qemu".into(),
                name: "virtqueue_pop".into(),
                pc: 0x4a1230,
                semaphore: 0x1b2c3e,
                args: "8@%rbx 8@%rax -4@%edx -4@%ecx".into(),
            }
        );
        assert_eq!(p[1].name, "virtio_notify");
    }

    #[test]
    fn malformed_notes_end_the_walk() {
        let good = note("qemu", "a", "", 1, 0);
        let mut sec = good.clone();
        // A note claiming more bytes than there are.
        sec.extend_from_slice(&8u32.to_le_bytes());
        sec.extend_from_slice(&0xffffu32.to_le_bytes());
        sec.extend_from_slice(&NT_STAPSDT.to_le_bytes());
        sec.extend_from_slice(b"stapsdt\0");
        assert_eq!(parse_stapsdt(&sec).len(), 1);
        // Another owner's note is skipped, the walk goes on.
        let mut other = Vec::new();
        other.extend_from_slice(&4u32.to_le_bytes());
        other.extend_from_slice(&4u32.to_le_bytes());
        other.extend_from_slice(&1u32.to_le_bytes());
        other.extend_from_slice(b"GNU\0abcd");
        other.extend(good);
        assert_eq!(parse_stapsdt(&other).len(), 1);
        assert!(parse_stapsdt(&[1, 2, 3]).is_empty());
        assert!(parse_stapsdt(&[0xff; 12]).is_empty());
    }
}

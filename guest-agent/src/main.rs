//! viotrace guest agent.

mod bpf {
    include!(concat!(env!("OUT_DIR"), "/viotrace_guest.skel.rs"));
}

fn main() -> anyhow::Result<()> {
    println!("viotrace-guest {}", env!("CARGO_PKG_VERSION"));
    Ok(())
}

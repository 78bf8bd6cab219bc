//! viotrace host agent.

mod bpf {
    include!(concat!(env!("OUT_DIR"), "/viotrace_host.skel.rs"));
}

fn main() -> anyhow::Result<()> {
    println!("viotrace-host {}", env!("CARGO_PKG_VERSION"));
    Ok(())
}

use std::env;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

const SRC: &str = "../bpf/host/viotrace_host.bpf.c";

fn main() {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR set by cargo"))
        .join("viotrace_host.skel.rs");
    SkeletonBuilder::new()
        .source(SRC)
        .clang_args(["-I../bpf/include", "-Wall", "-Wno-unused-function"])
        .build_and_generate(&out)
        .expect("compile BPF object and generate skeleton");
    println!("cargo:rerun-if-changed=../bpf/host");
    println!("cargo:rerun-if-changed=../bpf/include");
}

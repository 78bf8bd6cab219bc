use std::env;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

const SRC: &str = "../bpf/guest/viotrace_guest.bpf.c";

fn main() {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR set by cargo"))
        .join("viotrace_guest.skel.rs");
    SkeletonBuilder::new()
        .source(SRC)
        .clang_args(["-I../bpf/include", "-Wall", "-Wno-unused-function"])
        .build_and_generate(&out)
        .expect("compile BPF object and generate skeleton");
    println!("cargo:rerun-if-changed=../bpf/guest");
    println!("cargo:rerun-if-changed=../bpf/include");
}

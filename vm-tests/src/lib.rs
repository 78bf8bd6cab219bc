//! The viotrace QEMU lab.

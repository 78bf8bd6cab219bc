//! viotrace-shared: record types, wire protocol, clock synchronisation and the
//! guest↔host join engine. Pure Rust, no BPF.

pub mod capture;
pub mod cause;
pub mod chrome;
pub mod clock;
pub mod interference;
pub mod join;
pub mod jsonl;
pub mod metrics;
pub mod points;
pub mod proto;
pub mod record;
pub mod selfcost;
pub mod stages;
pub mod stats;
pub mod transport;
mod varint;
pub mod walltime;

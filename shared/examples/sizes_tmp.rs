fn main() {
    use std::mem::size_of;
    use viotrace_shared::*;
    println!("HostElem {}", size_of::<record::HostElem>());
    println!("GuestRq {}", size_of::<record::GuestRq>());
    println!("Points {}", size_of::<record::Points>());
    println!("Interference {}", size_of::<interference::Interference>());
    println!("Name {}", size_of::<record::Name>());
    println!("GuestRecord {}", size_of::<proto::GuestRecord>());
    println!("JoinedIo {}", size_of::<record::JoinedIo>());
}

//! The host decodes bytes that a guest controls: whatever arrives, the frame
//! decoder must return messages or typed errors, never panic, never allocate
//! beyond the frame limit, and whatever it accepts must survive a round trip.
#![no_main]

use libfuzzer_sys::fuzz_target;
use viotrace_shared::proto::{
    decode_payload, encode_frame, BatchReader, FrameDecoder, Inbound, ProtoError, MAX_FRAME,
};

fuzz_target!(|data: &[u8]| {
    // The whole input as one payload.
    if let Ok(m) = decode_payload(data) {
        roundtrip(&m);
    }
    // The input as a byte stream, fed in chunks whose sizes come from the first byte.
    let Some((&step, rest)) = data.split_first() else {
        return;
    };
    let step = (step as usize % 61) + 1;
    host_path(rest, step);
    let mut d = FrameDecoder::new();
    for chunk in rest.chunks(step) {
        d.feed(chunk);
        assert!(d.pending() <= MAX_FRAME + 4 + step);
        loop {
            match d.next_message() {
                Ok(Some(m)) => roundtrip(&m),
                Ok(None) => break,
                Err(ProtoError::Poisoned) => return,
                Err(_) => {}
            }
        }
    }
    let _ = d.finish();
});

fn roundtrip(m: &viotrace_shared::proto::Message) {
    let f = encode_frame(m).expect("a decoded message re-encodes");
    let back = decode_payload(&f[4..]).expect("a re-encoded message decodes");
    assert_eq!(&back, m);
}

/// The host agent's own path: batches skimmed by the network side, their
/// records read one at a time (a bad record is an error for that record).
fn host_path(bytes: &[u8], step: usize) {
    let mut d = FrameDecoder::new();
    let mut reader = BatchReader::new();
    for chunk in bytes.chunks(step) {
        d.feed(chunk);
        loop {
            match d.next_inbound() {
                Ok(Some(Inbound::Batch(b))) => {
                    let mut n = 0;
                    reader.read(&b, |_| n += 1);
                    assert_eq!(n, b.len());
                }
                Ok(Some(Inbound::Message(m))) => roundtrip(&m),
                Ok(None) => break,
                Err(ProtoError::Poisoned) => return,
                Err(_) => {}
            }
        }
    }
}

//! Stored content properties read back from any bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let whole = mirrorq::message::valid_properties(data);
    let props = mirrorq::message::decode_properties(data);
    let _ = mirrorq::message::expiration_ms(&props);
    if whole && !data.is_empty() {
        assert!(mirrorq::message::valid_properties(&mirrorq::message::encode_properties(&props)));
    }
});

//! The AMQP frame decoder (methods, field tables, content headers, bodies)
//! on any bytes: a frame, "more needed" or an error, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let mirrorq::amqp::Parsed::Frame(frame, used) = mirrorq::amqp::parse(rest) {
        assert!(used <= rest.len() && used > 0);
        let mut out = Vec::new();
        let _ = mirrorq::amqp::write_frame(&frame, &mut out);
        rest = &rest[used..];
    }
});

//! The Idempotency-Key header, its sf-string form, and a key read from a JSON body by pointer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idemgate::fuzzing::key(data));

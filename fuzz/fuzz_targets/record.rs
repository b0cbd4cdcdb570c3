//! The record decoder: bytes read from a store.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idemgate::fuzzing::record(data));

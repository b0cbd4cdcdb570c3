//! The configuration: TOML text, read and validated as the gateway loads it.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idemgate::fuzzing::config(data));

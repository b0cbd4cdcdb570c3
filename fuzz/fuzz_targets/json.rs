//! The JSON parser and canonical form, against serde_json.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idemgate::fuzzing::json(data));

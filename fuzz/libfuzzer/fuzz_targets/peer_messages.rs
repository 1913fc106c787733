#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvmesh_fuzz_targets::peer_messages(data));

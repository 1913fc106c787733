//! Raw bindings to the system UCX (`<ucp/api/ucp.h>`), generated at build
//! time. Only `ucp_*`, `UCP_*` and `UCS_*` items are kept. Use the safe
//! wrapper in `ffi/ucx` (crate `kvmesh-ucx`) instead of these.
//!
//! Rewritten by hand because they are macros or static inlines in C:
//! `ucp_init` (calls `ucp_init_version`), `UCS_PTR_IS_ERR`, `UCS_PTR_STATUS`,
//! `UCS_PTR_IS_PTR`.
#![allow(non_upper_case_globals, non_camel_case_types, non_snake_case, dead_code, missing_docs, unreachable_pub)]
#![allow(clippy::all, clippy::undocumented_unsafe_blocks)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// `UCS_PTR_IS_ERR`: status pointers encode errors as small negative values.
pub fn ucs_ptr_is_err(p: ucs_status_ptr_t) -> bool {
    (p as usize) >= (ucs_status_t::UCS_ERR_LAST.0 as isize as usize)
}

/// `UCS_PTR_IS_PTR`: a real request pointer (not NULL, not an error).
pub fn ucs_ptr_is_ptr(p: ucs_status_ptr_t) -> bool {
    (p as usize).wrapping_sub(1) < (ucs_status_t::UCS_ERR_LAST.0 as isize as usize).wrapping_sub(1)
}

/// `UCS_PTR_STATUS`: the status encoded in a status pointer.
pub fn ucs_ptr_status(p: ucs_status_ptr_t) -> ucs_status_t {
    ucs_status_t(p as isize as i8)
}

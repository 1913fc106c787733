//! Generates bindings to the system UCX found with pkg-config. Needs
//! `libucx-dev` (>= 1.13) and `libclang-dev`; `scripts/setup.sh` installs
//! both on Debian.

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    let ucx = match pkg_config::Config::new().atleast_version("1.13").probe("ucx") {
        Ok(l) => l,
        Err(e) => {
            panic!(
                "kvmesh-ucx-sys needs UCX >= 1.13 found by pkg-config (Debian: apt install libucx-dev; \
                 or run scripts/setup.sh): {e}"
            )
        }
    };
    // libucp links libuct and libucs transitively; name them explicitly for
    // static linkers and `-Wl,--as-needed` toolchains.
    for lib in ["ucp", "uct", "ucs"] {
        println!("cargo:rustc-link-lib={lib}");
    }
    let mut b = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_status_t")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        // ucs_status_t is a packed one-byte enum: a newtype, not a Rust enum
        // (UCX may return values a Rust enum could not represent).
        .newtype_enum("ucs_status_t")
        .bitfield_enum("ucp_params_field")
        .bitfield_enum("ucp_worker_params_field")
        .bitfield_enum("ucp_ep_params_field")
        .bitfield_enum("ucp_mem_map_params_field")
        .bitfield_enum("ucp_mem_attr_field")
        .bitfield_enum("ucp_feature")
        .bitfield_enum("ucp_op_attr_t")
        .bitfield_enum("ucp_worker_attr_field")
        .bitfield_enum("ucp_ep_attr_field")
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false);
    for p in &ucx.include_paths {
        b = b.clang_arg(format!("-I{}", p.display()));
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR set by cargo"));
    b.generate().expect("bindgen over <ucp/api/ucp.h>").write_to_file(out.join("bindings.rs")).expect("write bindings");
}

//! The committed `include/kvmesh.h` is what cbindgen generates from the
//! sources now. Regenerate with `KVMESH_BLESS=1 cargo test -p kvmesh-capi --test header`.

#[test]
fn header_is_up_to_date() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let cfg = cbindgen::Config::from_file(format!("{dir}/cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(cfg)
        .generate()
        .expect("cbindgen parses the C ABI")
        .write(&mut generated);
    // Negative constants in parentheses (`x-KVMESH_E_INVALID` must not
    // read as a decrement).
    let text = String::from_utf8(generated).unwrap();
    let mut fixed = String::with_capacity(text.len());
    for line in text.lines() {
        match line.strip_prefix("#define ").and_then(|r| r.split_once(' ')) {
            Some((name, value)) if value.starts_with('-') => fixed.push_str(&format!("#define {name} ({value})")),
            _ => fixed.push_str(line),
        }
        fixed.push('\n');
    }
    let generated = fixed.into_bytes();
    let path = format!("{dir}/include/kvmesh.h");
    if std::env::var_os("KVMESH_BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{path} is stale: regenerate it with KVMESH_BLESS=1 cargo test -p kvmesh-capi --test header"
    );
}

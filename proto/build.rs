//! Compiles the `.proto` files with `protox` (pure Rust), so building needs
//! no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["kvmesh/engine/v1/engine.proto", "kvmesh/peer/v1/peer.proto"];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["."])?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(fds)?;
    Ok(())
}

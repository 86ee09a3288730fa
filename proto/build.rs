//! Compiles `proto/federation.proto` (the hub-agent protocol) and
//! `proto/externalscaler.proto` (KEDA's, which the agent serves) with protox (pure Rust),
//! so no system `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/federation.proto", "proto/externalscaler.proto"];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(protos, ["proto"])?;
    // The manifest is rendered once and shared by every push: Bytes, not Vec<u8>.
    tonic_prost_build::configure()
        // tonic's prost codec with a smaller yield threshold (src/codec.rs).
        .codec_path("crate::codec::Codec")
        .bytes(".flotilla.federation.v1.Apply.manifest")
        // It carries a token: its Debug (lib.rs) prints it redacted.
        .skip_debug([".flotilla.federation.v1.RenewToken"])
        .compile_fds(descriptors)?;
    Ok(())
}

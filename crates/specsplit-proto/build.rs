//! Compiles `proto/specsplit.proto` with the pure-Rust `protox` compiler (no system `protoc`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let file = proto_dir.join("specsplit.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&proto_dir])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // Undecodable requests (e.g. trees nested deeper than protobuf's 100-level limit) are
        // INVALID_ARGUMENT, not INTERNAL.
        .codec_path("crate::codec::SpecCodec")
        .compile_fds(fds)?;
    Ok(())
}

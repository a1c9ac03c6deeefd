//! Compiles `proto/specsplit.proto` and the standard `grpc.health.v1` service
//! (`crates/specsplit-proto/proto/health.proto`, as published by gRPC) with the pure-Rust
//! `protox` compiler (no system `protoc`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let proto_dir = manifest.join("../../proto");
    let file = proto_dir.join("specsplit.proto");
    let health_dir = manifest.join("proto");
    let health = health_dir.join("health.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    println!("cargo:rerun-if-changed={}", health.display());
    let fds = protox::compile([&file, &health], [&proto_dir, &health_dir])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // Undecodable requests (garbage, invalid UTF-8, trees nested deeper than protobuf's
        // recursion limit) are INVALID_ARGUMENT, not INTERNAL; the health service too.
        .codec_path("crate::codec::SpecCodec")
        .compile_fds(fds)?;
    Ok(())
}

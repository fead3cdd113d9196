//! Compiles `proto/kas/*.proto` with protox (pure Rust, no system `protoc`).
//!
//! With the `grpc` feature the files go through tonic's generator (the real one, or
//! madsim's under `--cfg madsim`) and get clients and servers; without it prost emits
//! the messages alone, so `kas-core` can use them without any network crate.

use std::path::PathBuf;

const FILES: &[&str] = &[
    "kas/frame.proto",
    "kas/registry.proto",
    "kas/public_api.proto",
    "kas/private_api.proto",
    "kas/agent_api.proto",
    "kas/pods.proto",
    "kas/http.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let fds_path = out.join("kas_descriptor.bin");
    let fds = protox::Compiler::new(["proto"])?
        .include_imports(true)
        .open_files(FILES)?
        .encode_file_descriptor_set();
    std::fs::write(&fds_path, fds)?;
    println!("cargo:rerun-if-changed=proto");
    compile(&fds_path)
}

#[cfg(feature = "grpc")]
fn compile(fds_path: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    let builder = tonic_build::configure();
    // madsim's generator passes messages without encoding them, so it has no codec.
    #[cfg(not(madsim))]
    let builder = builder.codec_path("crate::codec::LeanCodec");
    builder
        .file_descriptor_set_path(fds_path)
        .skip_protoc_run()
        .compile_protos(FILES, &["proto"])?;
    Ok(())
}

#[cfg(not(feature = "grpc"))]
fn compile(fds_path: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    prost_build::Config::new()
        .file_descriptor_set_path(fds_path)
        .skip_protoc_run()
        .compile_protos(FILES, &["proto"])?;
    Ok(())
}

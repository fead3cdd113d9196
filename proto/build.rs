//! Compiles `proto/kas/*.proto` with protox (pure Rust, no system `protoc`).
//!
//! With the `grpc` feature the files go through tonic's generator (the real one, or
//! madsim's under `--cfg madsim`) and get clients and servers; without it prost emits
//! the messages alone, so `kas-core` can use them without any network crate.
//!
//! A call's messages and the HTTP exchange's pieces are `Bytes`: decoded from a received
//! buffer they are slices of it, not copies (a streamed response's pieces pass through
//! three processes).

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

/// Messages written by hand: GetPods' answer keeps the agent's bytes (see `pod_list.rs`).
const EXTERN: [(&str, &str); 1] = [(
    ".kas.public_api.GetPodsResponse",
    "crate::pod_list::GetPodsResponse",
)];

/// The fields decoded as `Bytes`.
const BYTES: [&str; 3] = [
    ".kas.frame.Message.data",
    ".kas.http.HttpRequest",
    ".kas.http.HttpResponse",
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
    let builder = EXTERN
        .into_iter()
        .fold(tonic_build::configure(), |b, (proto, rust)| {
            b.extern_path(proto, rust)
        });
    // madsim's generator passes messages without encoding them, so it has no codec.
    #[cfg(not(madsim))]
    let builder = builder.codec_path("crate::codec::LeanCodec");
    #[cfg(not(madsim))]
    let builder = BYTES.into_iter().fold(builder, |b, path| b.bytes(path));
    // madsim's takes them all at once.
    #[cfg(madsim)]
    let builder = builder.bytes(BYTES);
    builder
        .file_descriptor_set_path(fds_path)
        .skip_protoc_run()
        .compile_protos(FILES, &["proto"])?;
    Ok(())
}

#[cfg(not(feature = "grpc"))]
fn compile(fds_path: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    for (proto, rust) in EXTERN {
        config.extern_path(proto, rust);
    }
    config
        .bytes(BYTES)
        .file_descriptor_set_path(fds_path)
        .skip_protoc_run()
        .compile_protos(FILES, &["proto"])?;
    Ok(())
}

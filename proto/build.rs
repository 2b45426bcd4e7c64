//! Compiles `capstan/v1/*.proto` with protox (a pure-Rust protobuf compiler), so building the
//! workspace needs no `protoc` on the machine. The encoded file descriptor set is also written
//! out for gRPC server reflection.

use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "capstan/v1/common.proto",
        "capstan/v1/registration.proto",
        "capstan/v1/invocation.proto",
        "capstan/v1/runtime_service.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(files, ["."])?;
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("capstan_v1_descriptor.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    tonic_prost_build::configure()
        .build_transport(false)
        .compile_fds(descriptors)?;
    Ok(())
}

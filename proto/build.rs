//! Compiles the `.proto` files with protox (no system `protoc`) and tonic-prost-build.
//!
//! The admin API is generated apart: its `AllocateResponse.response` (a
//! `v1beta1.ContainerAllocateResponse`) is [`EncodedAnswer`](src/encoded_answer.rs), the
//! plugin's answer kept as its bytes, so the daemon sends it on without decoding and encoding
//! it again. Generated apart because the substitution applies to every use of the type in a
//! generation pass, and the device plugin API keeps the decoded message.

use std::path::PathBuf;

fn main() {
    let files = [
        "proto/pluginregistration.proto",
        "proto/deviceplugin.proto",
        "proto/csi.proto",
        "proto/admin.proto",
        "proto/podresources.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let mut fds = protox::compile(files, ["proto"]).expect("compile protos");
    let mut admin_fds = fds.clone();
    fds.file.retain(|f| f.name() != "admin.proto");
    admin_fds
        .file
        .retain(|f| matches!(f.name(), "admin.proto" | "deviceplugin.proto"));
    for f in &mut admin_fds.file {
        if f.name() == "deviceplugin.proto" {
            f.service.clear();
        }
    }
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)
        .expect("generate gRPC code");

    // The admin API, with the device plugin API's types taken from the pass above. The device
    // plugin API stays in the set for its descriptors (without its services, nothing of it is
    // generated again); the output goes to a directory of its own.
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR is set")).join("admin");
    std::fs::create_dir_all(&out).expect("create the admin API's output directory");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .out_dir(&out)
        .extern_path(".v1beta1", "crate::v1beta1")
        .extern_path(".v1beta1.ContainerAllocateResponse", "crate::EncodedAnswer")
        .compile_fds(admin_fds)
        .expect("generate the admin API's gRPC code");
}

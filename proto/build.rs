//! Compiles the `.proto` files with protox (no system `protoc`) and tonic-prost-build.

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
    let fds = protox::compile(files, ["proto"]).expect("compile protos");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)
        .expect("generate gRPC code");
}

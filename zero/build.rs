//! Compiles `csrc/` (the libtorch glue tch does not expose) against the same
//! libtorch headers torch-sys uses, and adds the libtorch rpath to this
//! crate's own test binaries.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=csrc");
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        // torch-sys always sets it when it found libtorch; without it nothing links anyway.
        println!("cargo:warning=DEP_TCH_LIBTORCH_LIB is not set: run `cargo xtask setup`");
        return;
    };
    let lib = std::fs::canonicalize(&lib).unwrap_or_else(|_| PathBuf::from(&lib));
    let root = lib.join("..");
    cc::Build::new()
        .cpp(true)
        .file("csrc/glue.cpp")
        .file("csrc/flops.cpp")
        .file("csrc/allocated.cpp")
        .file("csrc/loss.cpp")
        .file("csrc/linear_loss.cpp")
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        // libtorch's headers are noisy under -Wall; our own code is small.
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .warnings(false)
        .compile("zrt_glue");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
}

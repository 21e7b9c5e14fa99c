//! Bakes libtorch's folder into this package's binaries as an rpath, so
//! they start without LD_LIBRARY_PATH, under `zrt launch` or not. torch-sys
//! gives that folder only to the build scripts of packages that depend on
//! it directly, hence the `torch-sys` line in Cargo.toml.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        // The real folder, not a link to it that may later point elsewhere.
        let lib = std::fs::canonicalize(&lib).unwrap_or_else(|_| lib.into());
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    }
}

//! Bakes the libtorch lib dir into every binary, test and example of the `zrt`
//! package as an rpath, so they run without LD_LIBRARY_PATH.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        // Resolve the `.libtorch` link so binaries keep working from any clone.
        let lib = std::fs::canonicalize(&lib).unwrap_or_else(|_| lib.into());
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
        // `zrt launch` finds the wheel's NCCL next to it (see launch.rs).
        println!("cargo:rustc-env=ZRT_LIBTORCH_LIB={}", lib.display());
    }
}

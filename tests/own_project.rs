//! zrt as a user gets it: `examples/own-project` copied out of this
//! workspace, built by cargo as a project of its own (zrt a path
//! dependency, libtorch named by `LIBTORCH` as tch asks), then trained on
//! two ranks by `zrt launch` with no LD_LIBRARY_PATH.
//!
//! The build shares the workspace's target folder (cargo holds its lock
//! only while it builds, not while the tests run) and the template's
//! profile is the workspace's, so every dependency the workspace built is
//! reused, tch's C++ glue among them: only zrt's own crates compile again
//! (cargo tells a path dependency's builds apart by its path from the
//! workspace's root), about a minute and a half on two cores. In a
//! target folder of its own the build took 114-256 s in CI.
//!
//! In a test binary of its own: that build keeps both cores busy for
//! minutes, and tests beside it with bounded waits would share them.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::printed as text;

/// The template copied to a fresh folder outside the workspace, its `zrt`
/// dependency pointed at this checkout and the workspace's lock file beside
/// it (the same crate versions, so the build needs no registry).
fn copy_out(repo: &Path) -> PathBuf {
    let from = repo.join("examples/own-project");
    let to = std::env::temp_dir().join(format!("zrt-own-project-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&to);
    std::fs::create_dir_all(to.join("src")).unwrap();
    for f in ["build.rs", "ds_config.json", "src/main.rs"] {
        std::fs::copy(from.join(f), to.join(f)).unwrap();
    }
    let manifest = std::fs::read_to_string(from.join("Cargo.toml")).unwrap();
    let ours = r#"zrt = { path = "../.." }"#;
    assert!(
        manifest.contains(ours),
        "the template's zrt line changed: {manifest}"
    );
    let manifest = manifest.replace(ours, &format!("zrt = {{ path = {:?} }}", repo.display()));
    std::fs::write(to.join("Cargo.toml"), manifest).unwrap();
    std::fs::copy(repo.join("Cargo.lock"), to.join("Cargo.lock")).unwrap();
    to
}

/// A manifest's dev-profile settings, each as (section, line), comments
/// and blank lines left out.
fn dev_profile(manifest: &str) -> BTreeSet<(String, String)> {
    let mut section = String::new();
    let mut settings = BTreeSet::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.to_owned();
        } else if section.starts_with("[profile.dev") && !line.is_empty() && !line.starts_with('#')
        {
            settings.insert((section.clone(), line.to_owned()));
        }
    }
    settings
}

#[test]
fn a_project_of_ones_own_builds_against_zrt_and_trains_on_two_ranks() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The template's dev profile is the workspace's, setting for setting:
    // otherwise its build below compiles every dependency again (and a
    // user's debug build is not zrt's).
    let read = |p: &str| std::fs::read_to_string(repo.join(p)).unwrap();
    let (ours, template) = (
        dev_profile(&read("Cargo.toml")),
        dev_profile(&read("examples/own-project/Cargo.toml")),
    );
    assert!(ours.len() >= 8, "{ours:?}");
    assert_eq!(
        template, ours,
        "examples/own-project/Cargo.toml's dev profile is not the workspace's"
    );
    let dir = copy_out(repo);
    // `.cargo/config.toml` gives every process cargo starts LIBTORCH (the
    // workspace's `.libtorch`); outside the workspace the user sets it.
    // Given as the workspace's build saw it: torch-sys's build script
    // reruns, compiling tch's C++ glue again, when the value changes.
    let given = std::env::var("LIBTORCH").unwrap();
    let libtorch = std::fs::canonicalize(&given).unwrap();
    // The workspace's target folder: `CARGO_TARGET_DIR` when that is set
    // (relative to the checkout, as cargo reads it there).
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| repo.join("target"), |t| repo.join(t));
    let build = Command::new(env!("CARGO"))
        .args(["build", "--offline", "--quiet"])
        .current_dir(&dir)
        .env("LIBTORCH", &given)
        .env("CARGO_TARGET_DIR", &target)
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .output()
        .unwrap();
    assert!(
        build.status.success(),
        "building the project failed:\n{}",
        text(&build)
    );
    let bin = target.join("debug/own-project");

    let zrt = |program: &[&std::ffi::OsStr]| {
        Command::new(env!("CARGO_BIN_EXE_zrt"))
            .args(["launch", "--nproc-per-node", "2", "--"])
            .args(program)
            .current_dir(&dir)
            .env_remove("LD_LIBRARY_PATH")
            .env_remove("ZRT_TOKEN")
            .env("ZRT_TIMEOUT", "60")
            .output()
            .unwrap()
    };

    // Its rpath finds libtorch: the binary starts, and trains.
    let o = zrt(&[bin.as_os_str(), "ds_config.json".as_ref(), "60".as_ref()]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let mut sums = Vec::new();
    for r in 0..2 {
        let head = format!("[rank {r}] rank {r} of 2: loss ");
        let line = t
            .lines()
            .find(|l| l.starts_with(&head))
            .unwrap_or_else(|| panic!("{t}"));
        let (losses, sum) = line[head.len()..].split_once("; parameter sum ").unwrap();
        let (first, last) = losses.split_once(" -> ").unwrap();
        let (first, last): (f64, f64) = (first.parse().unwrap(), last.parse().unwrap());
        assert!(last < first / 5.0, "rank {r} did not learn: {t}");
        sums.push(sum.to_owned());
    }
    // Data-parallel ranks end with one model, to the last digit printed.
    assert_eq!(sums[0], sums[1], "{t}");

    // Without the rpath the rank cannot start, and the launcher says why
    // and where libtorch is. glibc's loader, run by hand, ignores the rpath
    // of the objects `--inhibit-rpath` names; the program's name there is
    // the empty string.
    let loader = Path::new("/lib64/ld-linux-x86-64.so.2");
    assert!(loader.exists(), "this test expects x86-64 Linux");
    let o = zrt(&[
        loader.as_os_str(),
        "--inhibit-rpath".as_ref(),
        "".as_ref(),
        bin.as_os_str(),
    ]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(127), "{t}");
    assert!(
        t.contains("error while loading shared libraries: libtorch")
            && t.contains(
                "exited with code 127, the dynamic loader's code for a shared library it could not find"
            )
            && t.contains(&format!("this zrt was built with {}", libtorch.join("lib").display())),
        "{t}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

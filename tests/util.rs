//! A temporary directory per test and a runner for the built `ckpt` binary.

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct Dir {
    pub tmp: tempfile::TempDir,
}

pub struct Out {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Dir {
    pub fn new() -> Dir {
        Dir {
            tmp: tempfile::tempdir().expect("tempdir"),
        }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.tmp.path().join(rel)
    }

    /// Runs `ckpt ARGS` in this directory.
    pub fn ckpt(&self, args: &[&str]) -> Out {
        self.run(Command::new(env!("CARGO_BIN_EXE_ckpt")).args(args))
    }

    /// Runs `ckpt ARGS` with a rayon pool of `threads`, asserting success: for the
    /// same-bytes-whatever-the-thread-count checks.
    pub fn ok_with_threads(&self, args: &[&str], threads: usize) -> Out {
        let o = self.run(
            Command::new(env!("CARGO_BIN_EXE_ckpt"))
                .args(args)
                .env("RAYON_NUM_THREADS", threads.to_string()),
        );
        assert_eq!(
            o.code, 0,
            "ckpt {args:?} failed:\n{}\n{}",
            o.stdout, o.stderr
        );
        o
    }

    /// Runs `ckpt ARGS` in `cwd` (a fixture's directory, for its relative paths).
    pub fn run_in(&self, cwd: &Path, args: &[&str]) -> Out {
        run_at(cwd, Command::new(env!("CARGO_BIN_EXE_ckpt")).args(args))
    }

    fn run(&self, cmd: &mut Command) -> Out {
        run_at(self.tmp.path(), cmd)
    }

    /// Runs and asserts success.
    pub fn ok(&self, args: &[&str]) -> Out {
        let o = self.ckpt(args);
        assert_eq!(
            o.code, 0,
            "ckpt {args:?} failed:\n{}\n{}",
            o.stdout, o.stderr
        );
        o
    }

    /// Runs and asserts failure with exit code 1.
    pub fn fails(&self, args: &[&str]) -> Out {
        let o = self.ckpt(args);
        assert_eq!(
            o.code, 1,
            "ckpt {args:?} should fail:\n{}\n{}",
            o.stdout, o.stderr
        );
        o
    }

    /// A sliced example checkpoint at `rel`.
    pub fn example(&self, rel: &str, mesh: &str) {
        self.ok(&[
            "example", rel, "--mesh", mesh, "--hidden", "16", "--vocab", "37",
        ]);
    }
}

fn run_at(cwd: &Path, cmd: &mut Command) -> Out {
    let o = cmd.current_dir(cwd).output().expect("run ckpt");
    Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

/// `got` holds exactly `want`'s tensors (names first, then each one's bytes, named by
/// `what` and the tensor where they differ).
pub fn assert_same_tensors(
    got: &std::collections::BTreeMap<String, Vec<u8>>,
    want: &std::collections::BTreeMap<String, Vec<u8>>,
    what: &str,
) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for (k, v) in want {
        assert!(&got[k] == v, "{what}: {k} differs");
    }
}

/// Every tensor of the checkpoint at `path`, assembled whole, by name.
pub fn full_tensors(path: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let ck = ckpt_core::Checkpoint::open(&[path.to_path_buf()]).expect("open");
    let mut out = std::collections::BTreeMap::new();
    for (name, t) in &ck.tensors {
        let full = ckpt_core::layout::region::Region::full(&t.shape);
        let target = ckpt_core::layout::plan::TargetTensor {
            name: name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            pieces: vec![ckpt_core::layout::Piece {
                global: full.clone(),
                local: full,
            }],
        };
        let plan = ckpt_core::layout::plan::CopyPlan::build(
            &ck,
            vec![ckpt_core::layout::plan::TargetFile {
                path: "x".into(),
                tensors: vec![target],
                metadata: Default::default(),
            }],
        )
        .expect("plan");
        out.insert(
            name.clone(),
            ckpt_core::engine::copy::assemble(&plan.files[0].tensors[0], &ck).expect("assemble"),
        );
    }
    out
}

/// The example model's original tensors on `mesh` (the values `ckpt example` wrote with
/// `--hidden 16 --vocab 37` and the given number of layers and `--optimizer`).
pub fn originals_of(
    mesh: &str,
    layers: u64,
    optimizer: bool,
) -> std::collections::BTreeMap<String, Vec<u8>> {
    let model = ckpt_core::engine::example::ExampleModel {
        hidden: 16,
        vocab: 37,
        layers,
        optimizer,
        ..Default::default()
    };
    let s = ckpt_core::engine::example::example_strategy(
        &model,
        &ckpt_core::layout::mesh::Mesh::parse(mesh).unwrap(),
    )
    .unwrap();
    s.tensors
        .iter()
        .map(|(n, l)| (n.clone(), ckpt_core::engine::example::example_tensor(n, l)))
        .collect()
}

/// The tensors of [`Dir::example`] on `mesh`.
pub fn example_originals(mesh: &str) -> std::collections::BTreeMap<String, Vec<u8>> {
    originals_of(mesh, 2, false)
}

/// Copies the directory tree `from` to `to` (created), files byte for byte: a fixture
/// to damage or to put beside another.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let dest = to.join(p.file_name().unwrap());
        if p.is_dir() {
            copy_dir(&p, &dest);
        } else {
            std::fs::copy(&p, &dest).unwrap();
        }
    }
}

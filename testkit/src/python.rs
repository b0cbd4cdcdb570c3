//! [`PythonEnv`]: a Python virtual environment with real client SDKs from PyPI (stripe-python,
//! grpcio), made once per target directory and shared by the tests that drive the gateway with
//! them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A virtual environment under a directory of the tests' own, with `packages` installed.
pub struct PythonEnv {
    dir: PathBuf,
}

impl PythonEnv {
    /// The environment `name` under `root` (an integration test's `CARGO_TARGET_TMPDIR`), made
    /// with `python3 -m venv` and `pip install packages` unless a previous run left it complete.
    /// Tests and test binaries that ask at once take turns on a lock file.
    pub fn with_packages(root: &Path, name: &str, packages: &[&str]) -> Self {
        std::fs::create_dir_all(root).expect("the tests' directory");
        let lock = std::fs::File::create(root.join(format!("{name}.lock"))).expect("a lock file");
        lock.lock().expect("the venv's lock");
        let env = PythonEnv {
            dir: root.join(name),
        };
        let stamp = env.dir.join("installed.txt");
        let wanted = packages.join("\n");
        if std::fs::read_to_string(&stamp).ok().as_deref() != Some(wanted.as_str()) {
            let _ = std::fs::remove_dir_all(&env.dir);
            run(Command::new("python3").args(["-m", "venv"]).arg(&env.dir));
            let pip = env.dir.join("bin/pip");
            run(Command::new(pip)
                .args(["install", "--quiet", "--disable-pip-version-check"])
                .args(packages));
            std::fs::write(&stamp, wanted).expect("the venv's stamp");
        }
        env
    }

    /// The command that runs `script` (Python source) in the environment, for a test to start
    /// as a child process of its own (a server).
    pub fn command(&self, script: &str) -> Command {
        let mut cmd = Command::new(self.dir.join("bin/python"));
        cmd.arg("-c").arg(script);
        cmd
    }

    /// Run `script` (Python source) with `args`; its output, whatever its exit status.
    pub fn run(&self, script: &str, args: &[&str]) -> Output {
        Command::new(self.dir.join("bin/python"))
            .arg("-c")
            .arg(script)
            .args(args)
            .output()
            .expect("the venv's python runs")
    }
}

/// Run `cmd`, or panic with its output.
fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed (python3 with venv and PyPI are needed; scripts/test installs python3-venv):\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

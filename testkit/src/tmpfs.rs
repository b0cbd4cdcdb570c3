//! A small file system that can be filled, for "the disk is full":
//!
//! ```ignore
//! let disk = Tmpfs::mount("8m").await;
//! let gateway = GatewayProcess::binary(bin).via(&disk.enter()).start(toml).await;
//! disk.fill(); // writes fail with ENOSPC in there
//! disk.free(); // room again
//! ```
//!
//! A tmpfs of a given size, mounted on a temporary directory in a mount namespace of its own:
//! nothing outside sees it, and it goes when its holder (a `sleep` in the namespace) is killed
//! on drop, whatever becomes of the test. Processes run in it through [`Tmpfs::enter`], which
//! also lets a process killed with `kill -9` start again on the same files. As root this needs
//! only `unshare -m`; otherwise the namespace is in a user namespace of its own (`-r`), where
//! an unprivileged user may mount a tmpfs.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::wait_until;

/// A tmpfs in a mount namespace of its own, unmounted with its holder on drop.
pub struct Tmpfs {
    dir: tempfile::TempDir,
    holder: Child,
    root: bool,
}

impl Tmpfs {
    /// Mount a tmpfs of `size` (`mount -o size=`, e.g. `"8m"`) on a fresh temporary directory,
    /// and wait until it is there.
    pub async fn mount(size: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = is_root();
        let script = format!("mount -t tmpfs -o size={size} tmpfs \"$1\" && exec sleep infinity");
        let holder = Command::new("unshare")
            .arg(if root { "-m" } else { "-rm" })
            .args(["sh", "-c", &script, "sh"])
            .arg(dir.path())
            .stdin(Stdio::null())
            .spawn()
            .expect("unshare (util-linux) must be installed");
        let disk = Tmpfs { dir, holder, root };
        let mounts = format!("/proc/{}/mounts", disk.holder.id());
        let target = disk.dir.path().display().to_string();
        wait_until(
            Duration::from_secs(10),
            "the tmpfs is mounted",
            async || {
                std::fs::read_to_string(&mounts).is_ok_and(|m| {
                    m.lines()
                        .any(|l| l.starts_with(&format!("tmpfs {target} ")))
                })
            },
        )
        .await;
        disk
    }

    /// The directory the tmpfs is mounted on, as processes started through [`Tmpfs::enter`]
    /// name it.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The command prefix that runs a program in the namespace, where the tmpfs is at
    /// [`Tmpfs::path`] (for [`Launch::via`](crate::gateway::Launch::via)).
    pub fn enter(&self) -> Vec<String> {
        let pid = self.holder.id().to_string();
        let mut prefix = vec!["nsenter".to_string(), "-t".into(), pid];
        if !self.root {
            prefix.extend(["-U".into(), "--preserve-credentials".into()]);
        }
        prefix.extend(["-m".into(), "--".into()]);
        prefix
    }

    /// `name` in the tmpfs, as this process reaches it (through the holder's root).
    pub fn outside(&self, name: &str) -> PathBuf {
        let inside = self
            .dir
            .path()
            .strip_prefix("/")
            .expect("an absolute temporary directory");
        PathBuf::from(format!("/proc/{}/root", self.holder.id()))
            .join(inside)
            .join(name)
    }

    /// Fill the tmpfs with a file of its own until a write fails; how many bytes that took.
    pub fn fill(&self) -> u64 {
        fill(&self.outside(FILLER))
    }

    /// Delete what [`Tmpfs::fill`] wrote.
    pub fn free(&self) {
        let _ = std::fs::remove_file(self.outside(FILLER));
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// The file [`Tmpfs::fill`] writes.
const FILLER: &str = "filler";

/// Write `path` until its file system is full; how many bytes it took.
pub fn fill(path: &Path) -> u64 {
    use std::io::Write;
    let mut file = std::fs::File::create(path).unwrap();
    let mut written = 0;
    for chunk in [1 << 20, 4096, 512] {
        let block = vec![0x5a; chunk];
        while file.write_all(&block).and_then(|()| file.flush()).is_ok() {
            written += chunk as u64;
        }
    }
    written
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
    })
}

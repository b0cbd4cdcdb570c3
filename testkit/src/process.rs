//! A fixture's child process, held so that it can be signalled, killed and started again
//! through a shared handle (`&self`: a test kills the redis-server its world shares), and killed
//! when the handle drops.

use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;

/// The process a fixture runs now, if any: none before its start, after a kill, or after it
/// exited and was let go of.
pub(crate) struct ChildProcess(Mutex<Option<Child>>);

impl ChildProcess {
    /// No process yet.
    pub(crate) fn none() -> Self {
        ChildProcess(Mutex::new(None))
    }

    /// Hold `child`, just started.
    pub(crate) fn hold(&self, child: Child) {
        *self.0.lock().unwrap() = Some(child);
    }

    /// Its process id, while held.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.0.lock().unwrap().as_ref().map(Child::id)
    }

    /// Whether a process is held (started, and neither killed nor let go of).
    pub(crate) fn held(&self) -> bool {
        self.0.lock().unwrap().is_some()
    }

    /// How the held process exited, if it has (reaped; still held).
    pub(crate) fn exit_status(&self) -> Option<ExitStatus> {
        self.0.lock().unwrap().as_mut()?.try_wait().unwrap()
    }

    /// Whether a process is held and has not exited.
    pub(crate) fn running(&self) -> bool {
        self.held() && self.exit_status().is_none()
    }

    /// Let go of the held process (one that exited).
    pub(crate) fn forget(&self) {
        self.0.lock().unwrap().take();
    }

    /// SIGKILL: no chance to clean up, as in a crash; reaped.
    pub(crate) fn kill9(&self) {
        if let Some(mut c) = self.0.lock().unwrap().take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Send `sig` (`-INT`, `-QUIT`: a shutdown of its own) and wait until it has exited.
    pub(crate) fn stop_with(&self, sig: &str) {
        if let Some(mut c) = self.0.lock().unwrap().take() {
            signal(c.id(), sig);
            let _ = c.wait();
        }
    }

    /// Send `sig` (`-STOP`, `-CONT`, `-TERM`) to the running process; panics when there is none
    /// or the signal cannot be sent.
    pub(crate) fn signal(&self, sig: &str) {
        let pid = self.pid().expect("running");
        assert!(signal(pid, sig), "kill {sig} {pid}");
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Send `sig` to `pid` with `kill`; whether it was sent.
pub(crate) fn signal(pid: u32, sig: &str) -> bool {
    Command::new("kill")
        .arg(sig)
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The processes `pid` started (nginx's workers, PostgreSQL's backends).
pub fn children(pid: u32) -> Vec<u32> {
    match std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")) {
        Ok(children) => children
            .split_whitespace()
            .filter_map(|c| c.parse::<u32>().ok())
            .collect(),
        // A kernel without CONFIG_PROC_CHILDREN: find them by their parent.
        Err(_) => children_by_ppid(pid),
    }
}

fn children_by_ppid(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            // Field 4 of /proc/<pid>/stat, after the parenthesised command name.
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    let rest = s.get(s.rfind(')')? + 1..)?;
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(parent)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_children_by_their_parent_as_the_kernel_lists_them() {
        let mut sh = Command::new("sh")
            .args(["-c", "sleep 5 & sleep 5 & wait"])
            .spawn()
            .unwrap();
        let pid = sh.id();
        std::thread::sleep(std::time::Duration::from_millis(300));
        let mut by_ppid = children_by_ppid(pid);
        by_ppid.sort();
        assert_eq!(by_ppid.len(), 2, "{by_ppid:?}");
        let mut listed = children(pid);
        listed.sort();
        assert_eq!(by_ppid, listed);
        for child in &by_ppid {
            signal(*child, "-TERM");
        }
        sh.wait().unwrap();
    }
}

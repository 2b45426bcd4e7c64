//! The handler process of a case, in a process group of its own, so that nothing it started
//! outlives the case: the group is killed when the case ends, or when the guard is dropped
//! (the runner failing or being stopped).

use std::time::Duration;

use tokio::process::Child;

/// A running conformance handler.
pub struct HandlerProcess {
    /// The process itself.
    pub child: Child,
    group: Option<u32>,
}

impl HandlerProcess {
    /// Guards a child spawned as the leader of its own process group.
    pub fn new(child: Child) -> Self {
        let group = child.id();
        Self { child, group }
    }

    /// Kills the whole group and reaps the process.
    pub async fn stop(&mut self) {
        self.kill_group();
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
    }

    fn kill_group(&mut self) {
        if let Some(group) = self.group.take() {
            // `kill -KILL -- -PGID`: every process of the group, the leader too.
            let _ = std::process::Command::new("kill")
                .args(["-KILL", "--", &format!("-{group}")])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

impl Drop for HandlerProcess {
    fn drop(&mut self) {
        self.kill_group();
    }
}

//! Starting the `specsplit-target` binary for a test.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Starts `specsplit-target` with `args` (which should listen on port 0) and waits for its
/// start-up log line; returns the process and its URL. Its log keeps being read (and dropped)
/// so the process never blocks on a full pipe.
pub fn spawn_target(args: &[&str]) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_specsplit-target"))
        .args(args)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped())
        .spawn()
        .expect("start specsplit-target");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let addr = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("worker log");
        if let Some(i) = line.find("addr=") {
            break line[i + 5..].split_whitespace().next().unwrap().to_string();
        }
    };
    (child, format!("http://{addr}"))
}

//! The access-log sink of the in-process tests (`authz.rs`, `observe.rs`): a
//! writer the sidecar logs into and the test reads back.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Where the sidecar's access log goes in these tests.
#[derive(Clone, Default)]
pub struct Sink(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Sink {
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }

    /// Every line parsed as JSON, once at least `n` are there (5 s at most).
    pub async fn lines(&self, n: usize) -> Vec<serde_json::Value> {
        for _ in 0..500 {
            let lines: Vec<serde_json::Value> = self
                .text()
                .lines()
                .map(|l| serde_json::from_str(l).expect("each line is JSON"))
                .collect();
            if lines.len() >= n {
                return lines;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("fewer than {n} access-log lines in 5 s:\n{}", self.text());
    }
}

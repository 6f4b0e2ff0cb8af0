//! One process per rank (`run --rank R --world-size N --nccl-id FILE`): a rank that never comes,
//! or dies while the others wait, ends them with one line naming it within `--rank-timeout`,
//! never a hang. The rendezvous happens before any GPU is touched, so it runs on any machine.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use glmcheck::pipeline::rendezvous::heartbeat_file;

/// `--rank-timeout` in the tests, seconds.
const TIMEOUT: u64 = 2;
/// Far beyond the timeout: a rank still running then is hanging.
const HANG: Duration = Duration::from_secs(60);

fn p(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

struct World {
    _dir: tempfile::TempDir,
    model: PathBuf,
    id: PathBuf,
    out: PathBuf,
}

fn world() -> World {
    let dir = common::scratch();
    let model = dir.path().join("m.gguf");
    common::synth_tiny(&model, &["--layers", "1"]);
    World {
        id: dir.path().join("nccl.id"),
        out: dir.path().join("t.trace"),
        model,
        _dir: dir,
    }
}

/// Rank `rank` of `size` processes, its stderr piped.
fn start_rank(w: &World, rank: usize, size: usize) -> Child {
    let (rank, size) = (rank.to_string(), size.to_string());
    Command::new(common::glmcheck_bin())
        .args(["run", p(&w.model), "--tokens", "1,2,3", "--backend", "cuda"])
        .args(["--tp", &size, "--rank", &rank, "--world-size", &size])
        .args([
            "--nccl-id",
            p(&w.id),
            "--rank-timeout",
            &TIMEOUT.to_string(),
        ])
        .args(["--out", p(&w.out)])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start a rank")
}

/// Wait (bounded) for `child` to end; its exit code and stderr.
fn finish(mut child: Child) -> (i32, String) {
    let start = Instant::now();
    while child.try_wait().expect("poll the rank").is_none() {
        if start.elapsed() > HANG {
            child.kill().expect("kill the hanging rank");
            panic!("a rank still waits after {HANG:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("the rank's output");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.code().expect("an exit code"), err)
}

/// Wait (bounded) until `file` exists, while `child`, which writes it, runs.
fn appears(file: &Path, child: &mut Child) {
    let start = Instant::now();
    while !file.exists() {
        if let Some(status) = child.try_wait().expect("poll the rank") {
            panic!(
                "the rank ended ({status}) before {} appeared",
                file.display()
            );
        }
        assert!(start.elapsed() < HANG, "{} never appeared", file.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_rank_that_never_comes_is_named_within_the_timeout() {
    let w = world();
    let start = Instant::now();
    let (code, err) = finish(start_rank(&w, 0, 2));
    let took = start.elapsed();
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(
        err.contains("rank 0 of 2: rank 1 did not arrive (no heartbeat in"),
        "{err}"
    );
    assert!(err.contains(p(&heartbeat_file(&w.id, 1))), "{err}");
    assert!(took >= Duration::from_secs(TIMEOUT), "{took:?}");
    assert!(!w.out.exists(), "no trace folder left behind");
}

#[test]
fn a_rank_killed_while_the_others_wait_is_named() {
    let w = world();
    // Rank 0 reads the heartbeat files before it first beats: started first, it sees every beat
    // of rank 1 as new, however soon rank 1 is killed.
    let mut rank0 = start_rank(&w, 0, 4);
    appears(&heartbeat_file(&w.id, 0), &mut rank0);
    let mut rank1 = start_rank(&w, 1, 4);
    appears(&heartbeat_file(&w.id, 1), &mut rank1);
    rank1.kill().expect("SIGKILL rank 1");
    rank1.wait().expect("reap rank 1");
    let killed = Instant::now();
    let (code, err) = finish(rank0);
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.contains("rank 1 stopped answering"), "{err}");
    assert!(err.contains("rank 2 did not arrive"), "{err}");
    assert!(err.contains("rank 3 did not arrive"), "{err}");
    let took = killed.elapsed();
    assert!(took < Duration::from_secs(TIMEOUT + 10), "{took:?}");
}

#[test]
fn a_stale_heartbeat_of_an_earlier_run_is_no_rank() {
    let w = world();
    std::fs::write(heartbeat_file(&w.id, 1), "beat 7").unwrap();
    let (code, err) = finish(start_rank(&w, 0, 2));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("rank 1 did not arrive"), "{err}");
}

//! Rank processes (`run --rank R --world-size N --nccl-id FILE`) meet before NCCL and watch each
//! other until the end, so that a rank that dies never leaves the others waiting for ever.
//!
//! NCCL's own waits (joining a communicator, every collective) have no deadline: a peer killed
//! mid-forward would hang the others. So each rank beats a counter into `FILE.rankR` beside the
//! NCCL id file, from a thread of its own (a long layer does not stop it). A rank first waits for
//! every peer's counter to move (a stale file of an earlier run never does), then keeps reading
//! them: a peer whose counter stands still for the timeout, or that says it exited, ends this
//! process with exit 2 and one line naming that rank, wherever the main thread is waiting.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// What a rank writes when its run ended well: the others stop watching it.
const DONE: &str = "done";
/// What a rank writes when it stops on an error: the others stop at once.
const EXITED: &str = "exited";

/// This rank's view of one peer.
struct Peer {
    rank: usize,
    file: PathBuf,
    /// The content last read, and when it last changed (or when watching began).
    last: Option<String>,
    since: Instant,
    /// Whether its counter was ever seen moving: it is running now.
    arrived: bool,
}

impl Peer {
    /// Read the peer's file again: a new beat means it is running now.
    fn poll(&mut self) {
        let now = std::fs::read_to_string(&self.file).ok();
        if now != self.last {
            self.last = now;
            self.since = Instant::now();
            self.arrived |= self.beating();
        }
    }

    fn beating(&self) -> bool {
        self.last.as_deref().is_some_and(|s| s.starts_with("beat "))
    }

    fn state(&self) -> Option<&str> {
        self.last.as_deref()
    }
}

/// The files and timing shared by the rendezvous and the watch after it.
struct Ranks {
    own: PathBuf,
    rank: usize,
    world: usize,
    timeout: Duration,
    peers: Vec<Peer>,
    beats: u64,
}

impl Ranks {
    /// How often a rank beats and reads: a tenth of the timeout, between 10 ms and 1 s.
    fn period(&self) -> Duration {
        (self.timeout / 10).clamp(Duration::from_millis(10), Duration::from_secs(1))
    }

    fn beat(&mut self) -> Result<()> {
        self.beats += 1;
        write_renamed(&self.own, &format!("beat {}", self.beats))
    }

    /// Why this rank cannot go on, naming every rank that is not answering; None while no
    /// peer exited on an error or was silent for the timeout.
    fn fault(&self) -> Option<String> {
        let done = |p: &Peer| p.arrived && p.state() == Some(DONE);
        let exited = |p: &Peer| p.arrived && p.state() == Some(EXITED);
        let timed_out = self
            .peers
            .iter()
            .any(|p| exited(p) || (!done(p) && p.since.elapsed() >= self.timeout));
        if !timed_out {
            return None;
        }
        // Once this rank gives up, every peer silent for more than two beats is named with it.
        let quiet = 2 * self.period();
        let why: Vec<String> = self
            .peers
            .iter()
            .filter(|p| !done(p))
            .filter_map(|p| {
                let silent = p.since.elapsed();
                let what = if exited(p) {
                    return Some(format!("rank {} exited on an error", p.rank));
                } else if silent < quiet {
                    return None;
                } else if p.arrived {
                    "stopped answering"
                } else {
                    "did not arrive"
                };
                Some(format!(
                    "rank {} {what} (no heartbeat in {} for {:.1} s)",
                    p.rank,
                    p.file.display(),
                    silent.as_secs_f64()
                ))
            })
            .collect();
        Some(format!(
            "rank {} of {}: {}; stopping instead of waiting (--rank-timeout {} s)",
            self.rank,
            self.world,
            why.join(", "),
            self.timeout.as_secs_f64()
        ))
    }
}

/// A rank that met its peers, beating and watching them from a thread until [`finish`] or drop.
///
/// [`finish`]: RankWatch::finish
pub struct RankWatch {
    own: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    finished: bool,
}

/// The heartbeat file of `rank` beside the NCCL id file `base`.
pub fn heartbeat_file(base: &Path, rank: usize) -> PathBuf {
    let mut name = base.as_os_str().to_owned();
    name.push(format!(".rank{rank}"));
    PathBuf::from(name)
}

/// Meet the other `world - 1` rank processes through heartbeat files beside `base`: every one
/// must be seen running within `timeout`, else an error naming the ranks that did not arrive.
/// Rank 0 first removes a stale `base` (the NCCL id file), which no peer reads before it has
/// seen rank 0 here.
pub fn join(base: &Path, rank: usize, world: usize, timeout: Duration) -> Result<RankWatch> {
    if rank == 0 {
        match std::fs::remove_file(base) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("{}: removing the old id", base.display()))
            }
            _ => {}
        }
    }
    let start = Instant::now();
    let mut ranks = Ranks {
        own: heartbeat_file(base, rank),
        rank,
        world,
        timeout,
        peers: (0..world)
            .filter(|&r| r != rank)
            .map(|r| Peer {
                rank: r,
                file: heartbeat_file(base, r),
                last: None,
                since: start,
                arrived: false,
            })
            .collect(),
        beats: 0,
    };
    // The first read is what an earlier run may have left: only a change after it counts.
    for p in &mut ranks.peers {
        p.last = std::fs::read_to_string(&p.file).ok();
    }
    loop {
        ranks.beat()?;
        for p in &mut ranks.peers {
            p.poll();
        }
        if ranks.peers.iter().all(|p| p.arrived) {
            break;
        }
        if let Some(why) = ranks.fault() {
            bail!("{}: {why}", base.display());
        }
        std::thread::sleep(ranks.period());
    }
    let stop = Arc::new(AtomicBool::new(false));
    let own = ranks.own.clone();
    let thread = {
        let stop = stop.clone();
        let base = base.to_path_buf();
        std::thread::spawn(move || watch(ranks, &base, &stop))
    };
    Ok(RankWatch {
        own,
        stop,
        thread: Some(thread),
        finished: false,
    })
}

/// Beat and read the peers until `stop`; a peer at fault ends the process (exit 2, as for any
/// error), since the main thread may be inside a collective that never returns.
fn watch(mut ranks: Ranks, base: &Path, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        if let Err(e) = ranks.beat() {
            eprintln!("glmcheck: error: {e:#}");
            std::process::exit(2);
        }
        for p in &mut ranks.peers {
            p.poll();
        }
        if let Some(why) = ranks.fault() {
            eprintln!("glmcheck: error: {}: {why}", base.display());
            std::process::exit(2);
        }
        std::thread::sleep(ranks.period());
    }
}

impl RankWatch {
    /// The run ended well: tell the peers, which stop watching this rank.
    pub fn finish(mut self) -> Result<()> {
        self.finished = true;
        self.stop_thread();
        write_renamed(&self.own, DONE)
    }

    fn stop_thread(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for RankWatch {
    /// A rank leaving on an error says so, and the peers stop at once instead of at the timeout.
    fn drop(&mut self) {
        if !self.finished {
            self.stop_thread();
            let _ = write_renamed(&self.own, EXITED);
        }
    }
}

/// Replace `path`'s content atomically (a reader sees the old or the new text, never a mix).
fn write_renamed(path: &Path, text: &str) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, text).with_context(|| tmp.display().to_string())?;
    std::fs::rename(&tmp, path).with_context(|| path.display().to_string())
}

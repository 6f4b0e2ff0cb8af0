//! Writes a trace as the run goes: statistics for every stage, full tensors for the selected
//! ones, one safetensors file per layer.
//!
//! Stages are grouped by layer (`L{n}.…`; every other stage, such as `embed` or `logits`, is a
//! group of its own). A group is written when the next one starts, or at [`TraceWriter::finish`]:
//! its tensors to `GROUP.safetensors` and then `manifest.json` with every finished group, each
//! under a temporary name renamed into place. Until [`TraceWriter::finish`] the manifest says
//! `"complete": false`, so a crashed or killed run leaves a readable trace of the groups it
//! finished, marked partial, and loses at most the one in progress.
//!
//! A stage's statistics and content hash are computed on the thread pool while the forward
//! goes on (some 200 MB a layer at GLM-5's widths and 512 tokens), on the stage's values copied
//! out of the forward or, where the forward is done with them, handed over
//! ([`TraceWriter::record_owned`]), or, where they are still on their way (a GPU's copy queued
//! beside the forward), when they arrive ([`TraceWriter::record_later`]), so that the forward
//! never waits for a stage it stores. A finished group goes to a writing thread, which waits for
//! its statistics and writes its file and the manifest while the forward runs the next layer
//! (a manifest write took up to 20 ms on a GPU host, a 512-token layer's tensors 5 ms); the run
//! is held back only when it gets `JOBS_AHEAD` jobs ahead of the disk.

mod values;

use std::borrow::Cow;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use safetensors::tensor::TensorView;
use serde_json::{Map, Value};

use super::error::{Result, TraceError};
use super::manifest::{ElemType, Manifest, ModelInfo, StageRecord, FORMAT, MANIFEST_NAME, VERSION};
use super::select::FullSelector;
use super::stats::{StatsLater, TensorStats};
use crate::model::stage::{layer_of, Place};
pub use values::{OwnedStage, Stage, StageLater};

/// The run-wide fields of a manifest.
#[derive(Clone, Debug, Default)]
pub struct TraceHeader {
    pub producer: Map<String, Value>,
    pub model: ModelInfo,
    pub tokens: Vec<u32>,
    pub backend: String,
    pub dtype: String,
    pub tp: u32,
}

/// A stage's statistics: its values until someone takes them to compute, then the statistics.
/// The values are shared with the group's full tensors when the stage is stored whole: one copy
/// serves both.
enum StatsCell {
    Values(Arc<OwnedStage>),
    Computing,
    Done(TensorStats),
}

/// A stage's record before its statistics and file are known.
fn stage_record(
    name: &str,
    shape: &[u64],
    dtype: ElemType,
    dims: &str,
    rank: Option<u32>,
) -> StageRecord {
    StageRecord {
        name: name.to_string(),
        shape: shape.to_vec(),
        dtype,
        dims: dims.to_string(),
        rank,
        // Filled in when the group is written.
        stats: TensorStats::of::<f32>(&[]),
        file: None,
        tensor: None,
        extra: Map::new(),
    }
}

/// A stage's statistics on their way.
enum PendingStats {
    /// Being computed on the thread pool. Whoever comes first takes the values and computes
    /// without holding the lock (the computation itself uses the pool, whose threads may be the
    /// ones asking); the pool's task never waits, and the writer waits only for a computation
    /// under way.
    OnPool(Arc<(Mutex<StatsCell>, Condvar)>),
    /// Started elsewhere (on a GPU, beside the values), finished by the writing thread.
    Later(Option<StatsLater>),
    /// Not started: the values are on their way ([`StageLater`]), and the writing thread starts
    /// them when they arrive; the full tensor's name where the stage is stored whole.
    Arriving(Option<(StageLater, Option<String>)>),
}

impl PendingStats {
    fn start(values: Arc<OwnedStage>) -> PendingStats {
        let cell = Arc::new((Mutex::new(StatsCell::Values(values)), Condvar::new()));
        let task = cell.clone();
        rayon::spawn(move || {
            if let Some(values) = claim(&task.0) {
                finish(&task, values.stats());
            }
        });
        PendingStats::OnPool(cell)
    }

    fn wait(&mut self) -> std::result::Result<TensorStats, String> {
        let cell = match self {
            PendingStats::OnPool(cell) => cell,
            PendingStats::Later(later) => {
                let later = later.take().ok_or("statistics already taken")?;
                return later().map_err(|e| format!("{e:#}"));
            }
            PendingStats::Arriving(_) => return Err("its values never arrived".into()),
        };
        let (state_cell, done) = &**cell;
        if let Some(values) = claim(state_cell) {
            let stats = values.stats();
            finish(cell, stats.clone());
            return Ok(stats);
        }
        let mut state = lock(state_cell);
        loop {
            if let StatsCell::Done(stats) = &*state {
                return Ok(stats.clone());
            }
            state = done.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }
}

fn lock(cell: &Mutex<StatsCell>) -> std::sync::MutexGuard<'_, StatsCell> {
    cell.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The values, when nobody has taken them yet.
fn claim(cell: &Mutex<StatsCell>) -> Option<Arc<OwnedStage>> {
    let mut state = lock(cell);
    match std::mem::replace(&mut *state, StatsCell::Computing) {
        StatsCell::Values(values) => Some(values),
        other => {
            *state = other;
            None
        }
    }
}

fn finish((cell, done): &(Mutex<StatsCell>, Condvar), stats: TensorStats) {
    *lock(cell) = StatsCell::Done(stats);
    done.notify_all();
}

/// A full tensor waiting for its group's file.
struct Held {
    name: String,
    shape: Vec<usize>,
    values: Arc<OwnedStage>,
}

/// The stages of the group in progress, each with its statistics on the way.
#[derive(Default)]
struct Group {
    name: String,
    stages: Vec<StageRecord>,
    stats: Vec<PendingStats>,
    held: Vec<Held>,
}

/// What the writing thread is sent: a finished group (none at the end), and what the run
/// learnt about itself since the last job, written into the manifest's `producer` with it.
struct Job {
    group: Option<Group>,
    facts: Vec<Fact>,
}

/// A `producer` entry of the manifest: set, or a layer's seconds added to `layer_seconds`.
enum Fact {
    Producer(String, Value),
    LayerSeconds(String, f64),
}

/// Groups the run may be ahead of the writing thread: a layer or two, so that memory held for
/// unwritten groups stays bounded when the disk is slow. (Facts wait for the next group rather
/// than take a place of their own: a layer's two timings must not hold the forward back.)
const JOBS_AHEAD: usize = 4;

/// An open trace being written. Finished groups go to a thread of their own, which waits for
/// their statistics and writes their tensors and the manifest: the forward goes on meanwhile.
pub struct TraceWriter {
    dir: PathBuf,
    full: FullSelector,
    tp: u32,
    open: Group,
    finished: HashSet<String>,
    jobs: Option<SyncSender<Job>>,
    /// Facts for the next job.
    facts: Vec<Fact>,
    /// The writing thread; it returns the manifest with every group it wrote, or its first
    /// error.
    thread: Option<JoinHandle<Result<Manifest>>>,
}

impl TraceWriter {
    /// Start a trace in folder `dir`, which must not exist or be empty (stale tensor files of an
    /// earlier run must not sit beside the new manifest). The empty manifest is written at once.
    pub fn create(dir: &Path, header: TraceHeader, full: FullSelector) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| TraceError::io(dir, e))?;
        let mut items = std::fs::read_dir(dir).map_err(|e| TraceError::io(dir, e))?;
        if items.next().is_some() {
            let why = "already holds files; give the trace a new name or remove it";
            return Err(TraceError::field(dir, "folder", why));
        }
        let manifest = Manifest {
            format: FORMAT.into(),
            version: VERSION,
            producer: header.producer,
            model: header.model,
            tokens: header.tokens,
            backend: header.backend,
            dtype: header.dtype,
            tp: header.tp,
            complete: false,
            stages: Vec::new(),
            extra: Map::new(),
        };
        write_manifest(dir, &manifest)?;
        let (jobs, queue) = sync_channel(JOBS_AHEAD);
        let thread_dir = dir.to_path_buf();
        let thread = std::thread::Builder::new()
            .name("trace-writer".into())
            .spawn(move || write_groups(&thread_dir, manifest, queue))
            .map_err(|e| TraceError::io(dir, e))?;
        Ok(TraceWriter {
            dir: dir.to_path_buf(),
            full,
            tp: header.tp,
            open: Group::default(),
            finished: HashSet::new(),
            jobs: Some(jobs),
            facts: Vec::new(),
            thread: Some(thread),
        })
    }

    /// Record stage `name` (docs/design.md §4) of row-major `shape` with dims spec `dims`, whole
    /// (`rank` None) or one rank's part. Its stats are kept; its values too when `--full`
    /// selects it. Starting a new layer writes the previous one.
    pub fn record(
        &mut self,
        name: &str,
        shape: &[u64],
        dims: &str,
        rank: Option<u32>,
        values: Stage<'_>,
    ) -> Result<()> {
        self.check_stage(name, shape, rank, values.len())?;
        self.add_stage(name, shape, dims, rank, Arc::new(values.to_owned()))
    }

    /// Whether stage `name`'s record is its statistics alone (the run does not store it whole):
    /// then [`Self::record_stats`] takes statistics computed where the values are.
    pub fn takes_stats(&self, name: &str) -> bool {
        !self.full.matches(name)
    }

    /// [`Self::record`] of an f32 stage of `len` values by its statistics alone, computed where
    /// its values are (a GPU) and finished when its group is written, for a stage that
    /// [`Self::takes_stats`].
    #[allow(clippy::too_many_arguments)] // a record's fields, as `record` takes them
    pub fn record_stats(
        &mut self,
        name: &str,
        shape: &[u64],
        dims: &str,
        rank: Option<u32>,
        len: usize,
        stats: StatsLater,
    ) -> Result<()> {
        self.check_stage(name, shape, rank, len)?;
        if !self.takes_stats(name) {
            let why = "is stored whole, so its values are needed, not only its statistics";
            return Err(TraceError::field(
                &self.dir,
                format!("stage \"{name}\""),
                why,
            ));
        }
        self.open
            .stages
            .push(stage_record(name, shape, ElemType::F32, dims, rank));
        self.open.stats.push(PendingStats::Later(Some(stats)));
        Ok(())
    }

    /// [`Self::record`] with the values handed over instead of copied.
    pub fn record_owned(
        &mut self,
        name: &str,
        shape: &[u64],
        dims: &str,
        rank: Option<u32>,
        values: OwnedStage,
    ) -> Result<()> {
        self.check_stage(name, shape, rank, values.view().len())?;
        self.add_stage(name, shape, dims, rank, Arc::new(values))
    }

    /// [`Self::record_owned`] of `len` values still on their way: the writing thread waits for
    /// them, then takes their statistics (and stores them where `--full` selects the stage), so
    /// that the run does not wait for them here.
    pub fn record_later(
        &mut self,
        name: &str,
        shape: &[u64],
        dims: &str,
        rank: Option<u32>,
        len: usize,
        values: StageLater,
    ) -> Result<()> {
        self.check_stage(name, shape, rank, len)?;
        // The element type is the values' own, set when they arrive.
        let mut record = stage_record(name, shape, ElemType::F32, dims, rank);
        let tensor = self.held_tensor(&mut record);
        self.open.stages.push(record);
        self.open
            .stats
            .push(PendingStats::Arriving(Some((values, tensor))));
        Ok(())
    }

    /// Where `--full` selects the stage of `record`: the name of its full tensor, set in the
    /// record with the group's file.
    fn held_tensor(&self, record: &mut StageRecord) -> Option<String> {
        if !self.full.matches(&record.name) {
            return None;
        }
        let tensor = match record.rank {
            Some(r) => format!("{}@rank{r}", record.name),
            None => record.name.clone(),
        };
        record.file = Some(format!("{}.safetensors", self.open.name));
        record.tensor = Some(tensor.clone());
        Some(tensor)
    }

    /// A stage's name, shape and rank checked before its values are copied; a new group
    /// writes the one before.
    fn check_stage(
        &mut self,
        name: &str,
        shape: &[u64],
        rank: Option<u32>,
        len: usize,
    ) -> Result<()> {
        let bad = |field: &str, reason: String| {
            TraceError::field(&self.dir, format!("stage \"{name}\" {field}"), reason)
        };
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        {
            return Err(bad(
                "name",
                "must be ASCII letters, digits, `.`, `_` or `-`".into(),
            ));
        }
        let numel = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
        if numel != Some(len as u64) {
            return Err(bad(
                "shape",
                format!("{shape:?} does not hold {len} values"),
            ));
        }
        if let Some(r) = rank.filter(|&r| r >= self.tp) {
            return Err(bad("rank", format!("{r} is not below tp = {}", self.tp)));
        }
        let group = group_of(name);
        if self.finished.contains(&group) {
            return Err(bad("name", format!("group `{group}` was already written")));
        }
        if self
            .open
            .stages
            .iter()
            .any(|s| s.name == name && s.rank == rank)
        {
            return Err(bad("name", "recorded twice".into()));
        }
        if group != self.open.name {
            self.close_group()?;
            self.open.name = group;
        }
        Ok(())
    }

    /// A checked stage's record in the open group, its statistics started and its full tensor
    /// kept when selected.
    fn add_stage(
        &mut self,
        name: &str,
        shape: &[u64],
        dims: &str,
        rank: Option<u32>,
        values: Arc<OwnedStage>,
    ) -> Result<()> {
        let mut record = stage_record(name, shape, values.view().elem_type(), dims, rank);
        if let Some(tensor) = self.held_tensor(&mut record) {
            self.open.held.push(Held {
                name: tensor,
                shape: shape.iter().map(|&d| d as usize).collect(),
                values: values.clone(),
            });
        }
        self.open.stages.push(record);
        self.open.stats.push(PendingStats::start(values));
        Ok(())
    }

    /// Set `key` of the manifest's `producer` (what a run learnt while running, such as each
    /// rank's peak GPU memory); written with the next group or at `finish`.
    pub fn set_producer(&mut self, key: &str, value: serde_json::Value) {
        self.facts.push(Fact::Producer(key.to_string(), value));
    }

    /// Add a layer's (or its FFN's) wall time to the manifest's `producer.layer_seconds`: where
    /// the traced forward spends its time.
    pub fn add_layer_seconds(&mut self, layer: &str, seconds: f64) {
        self.facts
            .push(Fact::LayerSeconds(layer.to_string(), seconds));
    }

    /// Write the group in progress and the final manifest, marked complete; the trace as
    /// written.
    pub fn finish(mut self) -> Result<Manifest> {
        self.close_group()?;
        if !self.facts.is_empty() {
            self.send(None)?;
        }
        self.jobs = None;
        let mut manifest = self.join()?;
        manifest.complete = true;
        write_manifest(&self.dir, &manifest)?;
        Ok(manifest)
    }

    /// Hand the open group to the writing thread.
    fn close_group(&mut self) -> Result<()> {
        let group = std::mem::take(&mut self.open);
        if group.stages.is_empty() {
            return Ok(());
        }
        self.finished.insert(group.name.clone());
        self.send(Some(group))
    }

    /// `group` and the facts so far to the writing thread.
    fn send(&mut self, group: Option<Group>) -> Result<()> {
        let job = Job {
            group,
            facts: std::mem::take(&mut self.facts),
        };
        let sent = self
            .jobs
            .as_ref()
            .is_some_and(|jobs| jobs.send(job).is_ok());
        if sent {
            return Ok(());
        }
        // The thread stopped: its error says why.
        self.jobs = None;
        self.join().map(|_| ())
    }

    /// Wait for the writing thread to end: the manifest as it wrote it, or its error.
    fn join(&mut self) -> Result<Manifest> {
        let stopped = || TraceError::field(&self.dir, "writer", "stopped after an earlier error");
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(written)) => written,
            Some(Err(_)) => Err(TraceError::field(
                &self.dir,
                "writer",
                "its thread panicked",
            )),
            None => Err(stopped()),
        }
    }
}

impl Drop for TraceWriter {
    /// A run that ends early (an error, a panic) still leaves every group it handed over
    /// written; the open one is lost, as it would be in a crash.
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The writing thread: each group's statistics awaited, its tensors written, then the manifest
/// rewritten with it, in the order they come.
fn write_groups(dir: &Path, mut manifest: Manifest, jobs: Receiver<Job>) -> Result<Manifest> {
    for Job { group, facts } in jobs {
        for fact in facts {
            match fact {
                Fact::Producer(key, value) => {
                    manifest.producer.insert(key, value);
                }
                Fact::LayerSeconds(layer, seconds) => {
                    let times = manifest
                        .producer
                        .entry("layer_seconds")
                        .or_insert_with(|| Value::Object(Map::new()));
                    if let Some(times) = times.as_object_mut() {
                        let total = times.get(&layer).and_then(|v| v.as_f64()).unwrap_or(0.0);
                        times.insert(layer, serde_json::json!(total + seconds));
                    }
                }
            }
        }
        let Some(mut group) = group else {
            continue;
        };
        arrive(dir, &mut group)?;
        for (stage, stats) in group.stages.iter_mut().zip(&mut group.stats) {
            stage.stats = stats.wait().map_err(|why| {
                TraceError::field(dir, format!("stage \"{}\" statistics", stage.name), why)
            })?;
        }
        if !group.held.is_empty() {
            write_tensors(dir, &group)?;
        }
        manifest.stages.extend(group.stages);
        write_manifest(dir, &manifest)?;
    }
    Ok(manifest)
}

/// The group's values on their way, waited for in order: each checked against its record, its
/// statistics started, and held for the group's file where it is stored whole.
fn arrive(dir: &Path, group: &mut Group) -> Result<()> {
    for (stage, stats) in group.stages.iter_mut().zip(&mut group.stats) {
        let PendingStats::Arriving(arriving) = stats else {
            continue;
        };
        let Some((later, tensor)) = arriving.take() else {
            continue;
        };
        let bad =
            |why: String| TraceError::field(dir, format!("stage \"{}\" values", stage.name), why);
        let values = Arc::new(later().map_err(|e| bad(format!("{e:#}")))?);
        let len = values.view().len() as u64;
        if stage.shape.iter().product::<u64>() != len {
            return Err(bad(format!(
                "{len} values arrived for shape {:?}",
                stage.shape
            )));
        }
        stage.dtype = values.view().elem_type();
        if let Some(name) = tensor {
            group.held.push(Held {
                name,
                shape: stage.shape.iter().map(|&d| d as usize).collect(),
                values: values.clone(),
            });
        }
        *stats = PendingStats::start(values);
    }
    Ok(())
}

fn write_tensors(dir: &Path, group: &Group) -> Result<()> {
    let path = dir.join(format!("{}.safetensors", group.name));
    let bytes: Vec<Cow<'_, [u8]>> = group.held.iter().map(|h| h.values.le_bytes()).collect();
    let views = group
        .held
        .iter()
        .zip(&bytes)
        .map(|(h, bytes)| {
            let view = TensorView::new(h.values.dtype(), h.shape.clone(), bytes);
            view.map(|v| (h.name.as_str(), v))
        })
        .collect::<Result<Vec<_>, _>>();
    write_renamed(&path, |tmp| {
        views
            .and_then(|v| safetensors::serialize_to_file(v, None, tmp))
            .map_err(|e| TraceError::field(tmp, "tensors", e.to_string()))
    })
}

fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<()> {
    let text = manifest.to_json();
    write_renamed(&dir.join(MANIFEST_NAME), |tmp| {
        std::fs::write(tmp, &text).map_err(|e| TraceError::io(tmp, e))
    })
}

/// The group a stage belongs to: its layer's `L{n}`, or the whole name outside the layers.
fn group_of(name: &str) -> String {
    match layer_of(name) {
        Some(l) => Place::Layer(l).to_string(),
        None => name.to_string(),
    }
}

/// Have `write` fill a temporary name beside `path`, then rename it: `path` is either absent,
/// the old version, or complete.
fn write_renamed(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = PathBuf::from(tmp);
    write(&tmp)?;
    std::fs::rename(&tmp, path).map_err(|e| TraceError::io(path, e))
}

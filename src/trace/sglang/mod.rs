//! SGLang's own tensor dumps read as an engine trace. SGLang's dumper (`DUMPER_ENABLE=1`,
//! `DUMPER_NON_INTRUSIVE_MODE=all`) hooks every module and has each rank write one `torch.save`
//! file per tensor; this module reads one forward pass of one request from such a folder, maps
//! SGLang's module names to glmcheck's stages ([`names`]), joins the ranks, and writes the
//! result as a trace in a scratch folder that lives as long as the [`Trace`].
//!
//! The files are pickles, which Python runs as code: they are read by [`pickle`], which builds
//! tensors and plain data only and refuses any other class.

pub mod names;
pub mod passes;
pub mod pickle;
pub mod pt;
pub mod scan;

mod stages;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::model::Glm5Config;
use crate::trace::error::{Result, TraceError};
use crate::trace::{FullSelector, ModelInfo, Trace, TraceHeader, TraceWriter};

use names::{Hook, Target};
use pickle::Obj;
use pt::Values;
use scan::Entry;
use stages::Source;

/// Which of SGLang's two mechanisms wrote a dump, and where its files are.
pub enum Layout {
    /// The dumper's files: `dir`, or `dir`'s only subfolder holding them (the dumper writes
    /// into `DUMPER_DIR/EXP_NAME/`).
    Dumper(PathBuf),
    /// The older per-pass files: each tensor-parallel rank's folder.
    Passes(BTreeMap<u32, PathBuf>),
}

/// Whether `dir` holds an SGLang dump of either kind.
pub fn is_dump(dir: &Path) -> bool {
    layout(dir).is_ok_and(|d| d.is_some())
}

/// The dump at `dir`; None where it is no SGLang dump (a trace folder, a model).
pub fn layout(dir: &Path) -> Result<Option<Layout>> {
    if !dir.is_dir() || dir.join("manifest.json").exists() {
        return Ok(None);
    }
    if let Some(ranks) = passes::rank_folders(dir)? {
        return Ok(Some(Layout::Passes(ranks)));
    }
    Ok(scan::dumper_folder(dir)?.map(Layout::Dumper))
}

/// Open `path`: a trace folder, or an SGLang dump folder read against `cfg` (the config of the
/// weights SGLang ran, which says the widths the ranks' parts are cut to) and recorded as a run
/// of `model` (their source and fingerprint).
pub fn open_candidate(path: &Path, cfg: &Glm5Config, model: ModelInfo) -> Result<Trace> {
    match layout(path)? {
        Some(layout) => import(path, &layout, cfg, model),
        None => Trace::open(path),
    }
}

/// Open `path` as [`open_candidate`] does, an SGLang dump read against the config `reference`
/// (a glmcheck trace) records.
pub fn open_against(path: &Path, reference: &Trace) -> Result<Trace> {
    if !is_dump(path) {
        return Trace::open(path);
    }
    let config = reference.manifest().model.config.clone();
    let cfg: Glm5Config = serde_json::from_value(config).map_err(|_| {
        let why = "holds no glmcheck model config, which an SGLang dump is read against \
                   (compare it with a trace glmcheck recorded, or use bisect MODEL --candidate)";
        TraceError::field(reference.dir(), "model.config", why)
    })?;
    let model = ModelInfo {
        config: Value::Null,
        ..reference.manifest().model.clone()
    };
    open_candidate(path, &cfg, model)
}

/// Reads the dump's tensors: a dumper file whole each time, a pass file's archive opened once
/// (its pickle indexes the whole pass).
#[derive(Default)]
pub(crate) struct Reader {
    passes: HashMap<PathBuf, pt::Archive>,
}

impl Reader {
    /// `e`'s tensor and metadata (a pass file's entries have none), errors naming the file.
    pub(crate) fn tensor(&mut self, e: &Entry) -> Result<(pt::PtTensor, Obj)> {
        let bad = |why: String| TraceError::field(&e.path, "contents", why);
        let Some((key, index)) = &e.item else {
            let file = pt::read(&e.path).map_err(bad)?;
            return match file.value {
                Some(t) => Ok((t, file.meta)),
                None => Err(TraceError::field(&e.path, "value", "not a tensor")),
            };
        };
        if !self.passes.contains_key(&e.path) {
            let archive = pt::Archive::open(&e.path).map_err(bad)?;
            self.passes.insert(e.path.clone(), archive);
        }
        let archive = self.passes.get_mut(&e.path).expect("inserted above");
        let value = archive.top.get(key).cloned();
        let item = match (value, index) {
            (Some(v), None) => Some(v),
            (Some(v), Some(i)) => v.as_seq().and_then(|l| l.get(*i)).cloned(),
            (None, _) => None,
        };
        let field = format!(
            "{key}{}",
            index.map(|i| format!("[{i}]")).unwrap_or_default()
        );
        let not_tensor = || TraceError::field(&e.path, &field, "not a tensor");
        let tensor = match item {
            Some(obj) => archive
                .tensor(&obj)
                .map_err(|why| TraceError::field(&e.path, &field, why))?,
            None => None,
        };
        Ok((tensor.ok_or_else(not_tensor)?, pickle::Obj::empty_dict()))
    }
}

/// The prompt's token ids, the same on every rank, and rank 0's metadata.
fn prompt(
    reader: &mut Reader,
    dir: &Path,
    entries: &[Entry],
    ranks: u32,
) -> Result<(Vec<u32>, Obj)> {
    let mut tokens: Option<Vec<u32>> = None;
    let mut meta = None;
    for rank in 0..ranks {
        let Some(e) = entries
            .iter()
            .find(|e| e.rank == rank && e.name == "input_ids")
        else {
            let why = format!(
                "rank {rank} has no input_ids file: the model's own forward was not hooked \
                 (register the dumper's hooks on the model, DUMPER_NON_INTRUSIVE_MODE=all)"
            );
            return Err(TraceError::field(dir, "input_ids", why));
        };
        let (t, m) = reader.tensor(e)?;
        let Values::I32(ids) = t.values else {
            return Err(TraceError::field(
                &e.path,
                "value",
                "input_ids are not integers",
            ));
        };
        let ids: Vec<u32> = ids.iter().map(|&i| i.max(0) as u32).collect();
        match &tokens {
            Some(first) if *first != ids => {
                let why = "other token ids than rank 0's: not one request on every rank";
                return Err(TraceError::field(&e.path, "value", why));
            }
            _ => tokens = Some(ids),
        }
        meta.get_or_insert(m);
    }
    if let Some(e) = entries.iter().find(|e| e.name == "seq_lens") {
        let (t, _) = reader.tensor(e)?;
        if t.shape.iter().product::<u64>() != 1 {
            let why = format!(
                "a batch of {} requests; glmcheck reads one request's forward (send one request \
                 while the dumper is on)",
                t.shape.iter().product::<u64>()
            );
            return Err(TraceError::field(&e.path, "seq_lens", why));
        }
    }
    Ok((tokens.unwrap_or_default(), meta.expect("ranks ≥ 1")))
}

/// `meta`'s plain data as JSON (the parallel info is ints, bools and strings).
fn to_json(obj: &Obj) -> Value {
    use pickle::Value as P;
    match &obj.value {
        P::None => Value::Null,
        P::Bool(b) => json!(b),
        P::Int(i) => json!(i),
        P::Float(f) => json!(f),
        P::Str(s) => json!(s),
        P::Tuple(v) | P::List(v) => Value::Array(v.iter().map(to_json).collect()),
        P::Dict(kv) => Value::Object(
            kv.iter()
                .map(|(k, v)| (k.as_str().unwrap_or("?").to_string(), to_json(v)))
                .collect(),
        ),
        _ => Value::Null,
    }
}

/// The tensor-parallel degree: the ranks present, checked against SGLang's parallel info.
fn tensor_parallel(dir: &Path, ranks: u32, info: &Value) -> Result<u32> {
    let size = |k: &str| info.get(k).and_then(Value::as_u64).unwrap_or(1);
    for (key, what) in [
        ("pp_size", "pipeline parallel"),
        ("attn_dp_size", "data-parallel attention"),
        ("attn_cp_size", "context-parallel attention"),
    ] {
        if size(key) > 1 {
            let why = format!(
                "{what} ({key} {}): each rank holds other tokens or layers; only tensor \
                 parallel dumps are read",
                size(key)
            );
            return Err(TraceError::field(dir, "sglang_parallel_info", why));
        }
    }
    let tp = info
        .get("tp_size")
        .and_then(Value::as_u64)
        .unwrap_or(ranks.into());
    if tp != u64::from(ranks) {
        let why = format!("tp_size {tp}, but files of {ranks} ranks");
        return Err(TraceError::field(dir, "sglang_parallel_info", why));
    }
    Ok(ranks)
}

/// Every stage's sources: the files (and columns) each rank's part comes from.
fn sources(cfg: &Glm5Config, entries: &[Entry]) -> Result<BTreeMap<String, Vec<Source>>> {
    let mut out: BTreeMap<String, Vec<Source>> = BTreeMap::new();
    let last = cfg.num_hidden_layers.saturating_sub(1);
    for e in entries {
        let Some(hook) = Hook::parse(&e.name) else {
            continue;
        };
        let Some(target) = hook.target() else {
            continue;
        };
        // A module shared by every layer (a cached rotary embedding) is named after the first;
        // the dumper's `layer_id` tag says which layer called it.
        let layer = e.layer_id.or(hook.layer);
        let placed: Vec<(String, stages::Cut)> = match (target, layer) {
            (Target::Stage(kind, split), Some(l)) if hook.layer.is_some() => {
                vec![(format!("L{l}.{kind}"), stages::Cut::Whole(split))]
            }
            (Target::Stage(kind, split), _) => vec![(kind.to_string(), stages::Cut::Whole(split))],
            (Target::FusedQkvA, Some(l)) => vec![
                (
                    format!("L{l}.attn.q_a"),
                    stages::Cut::Columns(0, cfg.q_lora_rank),
                ),
                (
                    format!("L{l}.attn.kv_a"),
                    stages::Cut::Columns(
                        cfg.q_lora_rank,
                        cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                    ),
                ),
            ],
            (Target::PreviousOut, Some(0)) if hook.layer.is_some() => Vec::new(),
            (Target::PreviousOut, Some(l)) if hook.layer.is_some() => {
                vec![(
                    format!("L{}.out", l - 1),
                    stages::Cut::Whole(names::Split::Replicated),
                )]
            }
            (Target::PreviousOut, _) => {
                vec![(
                    format!("L{last}.out"),
                    stages::Cut::Whole(names::Split::Replicated),
                )]
            }
            (Target::FusedQkvA, None) => Vec::new(),
        };
        for (stage, cut) in placed {
            let list = out.entry(stage.clone()).or_default();
            if let Some(twin) = list.iter().find(|s| s.entry.rank == e.rank) {
                let why = format!(
                    "the module ran twice in one forward ({} holds {stage} of rank {} too); \
                     glmcheck cannot tell which call is the stage",
                    twin.entry.path.display(),
                    e.rank
                );
                return Err(TraceError::field(&e.path, "name", why));
            }
            list.push(Source {
                entry: e.clone(),
                cut,
            });
        }
    }
    Ok(out)
}

/// Read the dump folder `dir` and write it as a trace in a scratch folder.
fn import(dir: &Path, layout: &Layout, cfg: &Glm5Config, model: ModelInfo) -> Result<Trace> {
    let (entries, mechanism) = match layout {
        Layout::Dumper(files) => (scan::one_forward(files)?, "SGLang's dumper"),
        Layout::Passes(ranks) => (passes::first_forward(ranks)?, "SGLang's tensor dump hook"),
    };
    let mut reader = Reader::default();
    let ranks = entries.iter().map(|e| e.rank).max().unwrap_or(0) + 1;
    for r in 0..ranks {
        if !entries.iter().any(|e| e.rank == r) {
            let why = format!("no files of rank {r}, but files of rank {}", ranks - 1);
            return Err(TraceError::field(dir, "rank", why));
        }
    }
    let (tokens, meta) = prompt(&mut reader, dir, &entries, ranks)?;
    let info = meta
        .get("sglang_parallel_info")
        .map(to_json)
        .unwrap_or(Value::Null);
    let tp = tensor_parallel(dir, ranks, &info)?;
    let by_stage = sources(cfg, &entries)?;
    let scratch = tempfile::tempdir().map_err(|e| TraceError::io(dir, e))?;
    let out = scratch.path().join("sglang.trace");
    let mut producer = Map::new();
    producer.insert("tool".into(), json!(mechanism));
    producer.insert("dump".into(), json!(dir.display().to_string()));
    producer.insert("ranks".into(), json!(tp));
    producer.insert("sglang_parallel_info".into(), info);
    if let Some(path) = meta.get("tokenizer_path").and_then(Obj::as_str) {
        producer.insert("tokenizer_path".into(), json!(path));
    }
    let header = TraceHeader {
        producer,
        // SGLang's dump does not say which config it read: none is recorded, none compared.
        model: ModelInfo {
            config: Value::Null,
            ..model
        },
        tokens: tokens.clone(),
        backend: "sglang".into(),
        dtype: stages::dump_dtype(&mut reader, &by_stage)?,
        tp,
    };
    let all = FullSelector::new(&["**"])?;
    let mut writer = TraceWriter::create(&out, header, all)?;
    let written = stages::write(
        &mut reader,
        &mut writer,
        cfg,
        &by_stage,
        (tokens.len() as u64, tp),
    )?;
    for (key, mut value) in written.producer {
        let passes = matches!(layout, Layout::Passes(_));
        if let (true, "notes", Value::Array(notes)) = (passes, key.as_str(), &mut value) {
            if !by_stage.contains_key("logits") {
                notes.push(json!(
                    "logits: SGLang's tensor dump hook writes a pass's logits into the next \
                     pass's file; generate two tokens (max_new_tokens 2) to have them"
                ));
            }
        }
        writer.set_producer(&key, value);
    }
    let mut manifest = writer.finish()?;
    if let Some(rows) = written.logits_rows {
        for s in manifest.stages.iter_mut().filter(|s| s.name == "logits") {
            s.extra.insert("rows".into(), json!(rows));
        }
        let path = out.join(crate::trace::manifest::MANIFEST_NAME);
        std::fs::write(&path, manifest.to_json()).map_err(|e| TraceError::io(&path, e))?;
    }
    Ok(Trace::open(&out)?.made_from(dir, scratch))
}

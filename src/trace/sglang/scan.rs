//! The files of an SGLang dump folder, from their names alone: SGLang's dumper names each file
//! by its tags, `step=S___rank=R___dump_index=I___name=N___…___layer_id=L.pt`, so a folder is
//! sorted into forward passes, ranks and hooks before any file is opened.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::trace::error::{Result, TraceError};

/// One dump file, by its name's tags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub path: PathBuf,
    pub step: u64,
    pub rank: u32,
    pub dump_index: u64,
    pub name: String,
    /// The `layer_id` tag the dumper's context gave (a layer's modules, and modules shared by
    /// every layer such as a cached rotary embedding, which only this tag places).
    pub layer_id: Option<u64>,
    /// In a pass file of the older mechanism: the tensor's key, and its index where the key
    /// holds a list; None for a file of the dumper, which holds one tensor.
    pub item: Option<(String, Option<usize>)>,
}

/// Parse a file name of SGLang's dumper; None for any other name.
pub fn parse_name(file: &str) -> Option<(u64, u32, u64, String, Option<u64>)> {
    let stem = file.strip_suffix(".pt")?;
    let mut tags: BTreeMap<&str, &str> = BTreeMap::new();
    for part in stem.split("___") {
        let (k, v) = part.split_once('=')?;
        tags.insert(k, v);
    }
    let layer_id = match tags.get("layer_id") {
        Some(v) => Some(v.parse().ok()?),
        None => None,
    };
    Some((
        tags.get("step")?.parse().ok()?,
        tags.get("rank")?.parse().ok()?,
        tags.get("dump_index")?.parse().ok()?,
        tags.get("name")?.to_string(),
        layer_id,
    ))
}

/// The dump files directly in `dir`; an error names a `.pt` file whose name is not the dumper's.
fn entries_in(dir: &Path) -> Result<Vec<Entry>> {
    let mut out = Vec::new();
    for item in std::fs::read_dir(dir).map_err(|e| TraceError::io(dir, e))? {
        let item = item.map_err(|e| TraceError::io(dir, e))?;
        let file = item.file_name();
        let Some(file) = file.to_str().filter(|f| f.ends_with(".pt")) else {
            continue;
        };
        let Some((step, rank, dump_index, name, layer_id)) = parse_name(file) else {
            let why =
                "not named step=…___rank=…___dump_index=…___name=… as SGLang's dumper names files";
            return Err(TraceError::field(item.path(), "file name", why));
        };
        out.push(Entry {
            path: item.path(),
            step,
            rank,
            dump_index,
            name,
            layer_id,
            item: None,
        });
    }
    out.sort_by_key(|e| (e.step, e.rank, e.dump_index));
    Ok(out)
}

/// The folder holding the dumper's files, if any: `dir`, or `dir`'s only subfolder holding
/// them (the dumper writes into `DUMPER_DIR/EXP_NAME/`).
pub fn dumper_folder(dir: &Path) -> Result<Option<PathBuf>> {
    // A file named as the dumper names them: a model folder's own `.pt` files do not make it a
    // dump.
    let has_pt = |d: &Path| -> Result<bool> {
        let items = std::fs::read_dir(d).map_err(|e| TraceError::io(d, e))?;
        Ok(items
            .flatten()
            .any(|i| parse_name(&i.file_name().to_string_lossy()).is_some()))
    };
    if has_pt(dir)? {
        return Ok(Some(dir.to_path_buf()));
    }
    let mut subs = Vec::new();
    for item in std::fs::read_dir(dir)
        .map_err(|e| TraceError::io(dir, e))?
        .flatten()
    {
        if item.path().is_dir() && has_pt(&item.path())? {
            subs.push(item.path());
        }
    }
    match subs.len() {
        0 => Ok(None),
        1 => Ok(subs.pop()),
        n => {
            let names: Vec<String> = subs
                .iter()
                .filter_map(|s| s.file_name().map(|f| f.to_string_lossy().into_owned()))
                .collect();
            let why = format!(
                "{n} experiment folders of SGLang dumps ({}); name one of them",
                names.join(", ")
            );
            Err(TraceError::field(dir, "folder", why))
        }
    }
}

/// The files of one dump folder, checked to be one forward pass: a folder with several steps
/// is refused with each step's files counted.
pub fn one_forward(dir: &Path) -> Result<Vec<Entry>> {
    let entries = entries_in(dir)?;
    let mut steps: BTreeMap<u64, usize> = BTreeMap::new();
    for e in &entries {
        *steps.entry(e.step).or_default() += 1;
    }
    if steps.len() > 1 {
        let each: Vec<String> = steps
            .iter()
            .map(|(s, n)| format!("step {s}: {n} files"))
            .collect();
        let why = format!(
            "{} forward passes ({}); glmcheck reads one forward of one request: dump a \
             single prefill (max_new_tokens 1, the dumper enabled for that request only) or \
             move one step's files into a folder of their own",
            steps.len(),
            each.join(", ")
        );
        return Err(TraceError::field(dir, "step", why));
    }
    if entries.is_empty() {
        return Err(TraceError::field(dir, "folder", "holds no dump files"));
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_give_their_tags() {
        let f = "step=0___rank=1___dump_index=7___name=non_intrusive__model.layers.1.mlp.output\
                 ___recompute_status=disabled___layer_id=1.pt";
        let (step, rank, index, name, layer) = parse_name(f).unwrap();
        assert_eq!((step, rank, index, layer), (0, 1, 7, Some(1)));
        assert_eq!(name, "non_intrusive__model.layers.1.mlp.output");
        let root = "step=2___rank=0___dump_index=1___name=input_ids___recompute_status=disabled.pt";
        assert_eq!(parse_name(root).unwrap().4, None);
        assert_eq!(parse_name("weights.pt"), None);
        assert_eq!(
            parse_name("step=x___rank=0___dump_index=1___name=a.pt"),
            None
        );
    }

    #[test]
    fn a_folder_is_a_dump_by_the_dumpers_file_names_only() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("optimizer.pt"), b"").unwrap();
        assert_eq!(
            dumper_folder(dir.path()).unwrap(),
            None,
            "a model's own .pt"
        );
        let exp = dir.path().join("exp");
        std::fs::create_dir(&exp).unwrap();
        let name = "step=0___rank=0___dump_index=1___name=input_ids.pt";
        std::fs::write(exp.join(name), b"").unwrap();
        assert_eq!(dumper_folder(dir.path()).unwrap(), Some(exp));
    }
}

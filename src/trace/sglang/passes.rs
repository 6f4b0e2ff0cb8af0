//! SGLang's older dump (`--debug-tensor-dump-output-folder DIR`): a folder per rank,
//! `TP{t}_PP{p}_Rank{r}_pid{pid}/`, holding one `Pass{NNNNN}.pt` per forward pass, a dict from
//! module name to the module's output (a tensor, or a list of them). Only leaf modules and the
//! model's root are hooked, and outputs only.
//!
//! Its entries are given the names SGLang's dumper gives the same tensors, so that one name map
//! serves both. The hook writes a pass when the model's root module returns, so whatever runs
//! after it, the logits processor, lands in the next pass's file: the first pass (the prefill,
//! since the flag turns the server's warm-up off) is read, and its logits from the second pass
//! where there is one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::trace::error::{Result, TraceError};

use super::names::HOOK_PREFIX;
use super::pickle::Value;
use super::pt::Archive;
use super::scan::Entry;

/// `TP{t}_PP{p}_Rank{r}_pid{pid}` → (t, p).
fn rank_folder(name: &str) -> Option<(u32, u32)> {
    let rest = name.strip_prefix("TP")?;
    let (tp, rest) = rest.split_once("_PP")?;
    let (pp, rest) = rest.split_once("_Rank")?;
    let (_rank, pid) = rest.split_once("_pid")?;
    pid.parse::<u64>().ok()?;
    Some((tp.parse().ok()?, pp.parse().ok()?))
}

/// The rank folders of `dir`, by tensor-parallel rank; None where there are none.
pub fn rank_folders(dir: &Path) -> Result<Option<BTreeMap<u32, PathBuf>>> {
    let mut out = BTreeMap::new();
    for item in std::fs::read_dir(dir)
        .map_err(|e| TraceError::io(dir, e))?
        .flatten()
    {
        let name = item.file_name().to_string_lossy().into_owned();
        let Some((tp, pp)) = rank_folder(&name).filter(|_| item.path().is_dir()) else {
            continue;
        };
        if pp > 0 {
            let why = "a pipeline-parallel rank's folder: only tensor-parallel dumps are read";
            return Err(TraceError::field(item.path(), "folder", why));
        }
        if let Some(twin) = out.insert(tp, item.path()) {
            let why = format!(
                "a second folder of TP rank {tp} (beside {}): dumps of two server runs; keep one",
                twin.display()
            );
            return Err(TraceError::field(item.path(), "folder", why));
        }
    }
    Ok((!out.is_empty()).then_some(out))
}

/// The pass files of one rank folder, in pass order.
fn pass_files(folder: &Path) -> Result<Vec<PathBuf>> {
    let mut out: Vec<(u64, PathBuf)> = Vec::new();
    for item in std::fs::read_dir(folder)
        .map_err(|e| TraceError::io(folder, e))?
        .flatten()
    {
        let name = item.file_name().to_string_lossy().into_owned();
        let pass = name
            .strip_prefix("Pass")
            .and_then(|n| n.strip_suffix(".pt"))
            .and_then(|n| n.parse().ok());
        if let Some(pass) = pass {
            out.push((pass, item.path()));
        }
    }
    out.sort();
    Ok(out.into_iter().map(|(_, p)| p).collect())
}

/// The dumper's name for this mechanism's `key` (item `index` of a list); the modules whose
/// output is another module's input or output in the dumper's map are renamed to those.
fn dumper_name(key: &str, index: Option<usize>) -> String {
    match key {
        "model.forward_batch_info.input_ids" => return "input_ids".into(),
        "model.forward_batch_info.seq_lens" => return "seq_lens".into(),
        "logits_processor" => {
            return format!("{HOOK_PREFIX}logits_processor.output.next_token_logits")
        }
        _ => {}
    }
    // The attention's output is o_proj's input; a dense MLP's or the shared experts' down
    // projection is their block's output (its partial sum, as the block returns it).
    let module = if let Some(layer) = key.strip_suffix(".self_attn.attn_mha") {
        return format!("{HOOK_PREFIX}{layer}.self_attn.o_proj.inputs.0");
    } else if let Some(block) = key.strip_suffix(".down_proj") {
        block.to_string()
    } else {
        key.to_string()
    };
    match index {
        Some(i) => format!("{HOOK_PREFIX}{module}.output.{i}"),
        None => format!("{HOOK_PREFIX}{module}.output"),
    }
}

/// The entries of `path`'s dict (keys `only` where given), as the dumper would name them.
fn entries_of(path: &Path, rank: u32, pass: u64, only: Option<&str>) -> Result<Vec<Entry>> {
    let archive = Archive::open(path).map_err(|why| TraceError::field(path, "contents", why))?;
    let Value::Dict(items) = &archive.top.value else {
        let why = "not a dict of module outputs, as SGLang's tensor dump hook writes";
        return Err(TraceError::field(path, "contents", why));
    };
    let mut out = Vec::new();
    for (index, (k, v)) in items.iter().enumerate() {
        let Some(key) = k.as_str().filter(|k| only.is_none_or(|o| o == *k)) else {
            continue;
        };
        let items: Vec<Option<usize>> = match v.as_seq() {
            Some(list) => (0..list.len()).map(Some).collect(),
            None => vec![None],
        };
        for item in items {
            out.push(Entry {
                path: path.to_path_buf(),
                step: pass,
                rank,
                dump_index: index as u64,
                name: dumper_name(key, item),
                layer_id: None,
                item: Some((key.to_string(), item)),
            });
        }
    }
    Ok(out)
}

/// The entries of the first forward pass of every rank, and its logits from the second pass.
pub fn first_forward(ranks: &BTreeMap<u32, PathBuf>) -> Result<Vec<Entry>> {
    let mut out = Vec::new();
    for (&rank, folder) in ranks {
        let passes = pass_files(folder)?;
        let Some(first) = passes.first() else {
            return Err(TraceError::field(
                folder,
                "folder",
                "holds no Pass*.pt file",
            ));
        };
        out.extend(entries_of(first, rank, 0, None)?);
        if let Some(second) = passes.get(1) {
            out.extend(entries_of(second, rank, 0, Some("logits_processor"))?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_take_the_dumpers_names() {
        assert_eq!(rank_folder("TP3_PP0_Rank3_pid4711"), Some((3, 0)));
        assert_eq!(rank_folder("TP3_PP0_Rank3"), None);
        let name = |k, i| dumper_name(k, i);
        assert_eq!(
            name("model.layers.1.post_attention_layernorm", Some(1)),
            "non_intrusive__model.layers.1.post_attention_layernorm.output.1"
        );
        assert_eq!(
            name("model.layers.1.self_attn.attn_mha", None),
            "non_intrusive__model.layers.1.self_attn.o_proj.inputs.0"
        );
        assert_eq!(
            name("model.layers.1.mlp.shared_experts.down_proj", None),
            "non_intrusive__model.layers.1.mlp.shared_experts.output"
        );
        assert_eq!(
            name("model.forward_batch_info.input_ids", None),
            "input_ids"
        );
    }
}

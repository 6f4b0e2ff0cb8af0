//! What every fuzz target does with its input: write it to a file, open that file as a model
//! and dequantize the first rows of every tensor it lists. Nothing may panic, and every error must
//! name the file.
//!
//! glmcheck reads models from files (memory-mapped), so the input goes through a file rather than
//! a new byte-slice entry point that the real program would never use.

use std::sync::OnceLock;

use glmcheck::weights::ModelFiles;

/// Rows dequantized per tensor: enough to reach every decoder, little enough to stay fast.
const ROWS: u64 = 4;

/// A scratch folder for this fuzzing process, created once.
fn scratch() -> &'static tempfile::TempDir {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("create a scratch folder"))
}

/// Open `data` as a model file named `input.EXT` and dequantize the first rows of each tensor.
pub fn open_and_dequantize(data: &[u8], ext: &str) {
    let path = scratch().path().join(format!("input.{ext}"));
    std::fs::write(&path, data).expect("write the input file");
    let name = path.display().to_string();
    let assert_named = |e: glmcheck::weights::WeightError| {
        let msg = e.to_string();
        assert!(msg.contains(&name), "error does not name the file: {msg}");
    };
    let files = match ModelFiles::open(&path) {
        Ok(files) => files,
        Err(e) => return assert_named(e),
    };
    for t in files.tensors() {
        if let Err(e) = files.dequantize_rows(t, 0..t.rows().min(ROWS)) {
            assert_named(e);
        }
    }
}

/// Open `data` as the `manifest.json` of a trace folder and read every stage it lists (whose
/// tensor files are absent or whatever an earlier input left): errors must name the folder.
pub fn open_trace(data: &[u8]) {
    let dir = scratch().path().join("input.trace");
    std::fs::create_dir_all(&dir).expect("create the trace folder");
    std::fs::write(dir.join("manifest.json"), data).expect("write the manifest");
    let name = dir.display().to_string();
    let trace = match glmcheck::trace::Trace::open(&dir) {
        Ok(t) => t,
        Err(e) => return assert!(e.to_string().contains(&name), "unnamed: {e}"),
    };
    for s in trace.stages() {
        if let Err(e) = trace.tensor(&s.name, s.rank) {
            assert!(e.to_string().contains(&name), "unnamed: {e}");
        }
    }
}

/// Read `data` as an engine's shard manifest: errors must name the file.
pub fn read_shard_manifest(data: &[u8]) {
    let path = scratch().path().join("shards.json");
    std::fs::write(&path, data).expect("write the manifest");
    if let Err(e) = glmcheck::shard::manifest::ShardManifest::read(&path) {
        let msg = format!("{e:#}");
        assert!(msg.contains(&path.display().to_string()), "unnamed: {msg}");
    }
}

/// Read `data` as one file of an SGLang dump (a `torch.save` archive whose pickle is read as
/// data only): any outcome but a panic.
pub fn read_sglang_file(data: &[u8]) {
    let path = scratch()
        .path()
        .join("step=0___rank=0___dump_index=1___name=input_ids.pt");
    std::fs::write(&path, data).expect("write the dump file");
    let _ = glmcheck::trace::sglang::pt::read(&path);
}

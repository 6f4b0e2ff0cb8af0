//! Dequantization throughput, GB/s of f32 written: glmcheck on one and two rayon threads, candle's
//! CPU dequantizer and gguf-py's numpy one, all on the same random valid blocks, and one core's
//! plain f32 write loop over the same output (the ceiling a dequantizer writing f32 works under).
//!
//! `benches/gguf_py_dequant.py` writes the blocks (about 64 MiB of f32 per type) and times gguf-py;
//! this program times the Rust contenders, checks once per type that glmcheck and candle give the
//! same bits, prints the table and writes it as Markdown to `bench-results/dequant.md`.
//!
//! Run with `cargo bench --bench dequant` (after `scripts/setup-venv`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::quantized::k_quants::{
    self, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1,
    BlockQ6K, BlockQ8_0,
};
use comfy_table::{presets, Table, TableStyle};
use glmcheck::weights::quant;
use glmcheck::weights::GgmlType;

/// The types measured: every k-quant and legacy quant, the IQ4s, and IQ2_XXS.
const TYPES: [&str; 13] = [
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL",
    "IQ4_XS", "IQ2_XXS",
];
/// f32 output per type.
const MIB: usize = 64;
/// Elements per row handed to `dequantize_rows` (a whole number of blocks of every type).
const ROW_LEN: usize = 4096;
/// Timed runs per contender; the best counts, the others absorb page faults and noise.
const REPS: usize = 5;
/// Timed runs of gguf-py per type (it is slow, and steadier).
const PY_REPS: usize = 3;

/// One type's results; `None` where a contender lacks the type.
struct Row {
    ty: GgmlType,
    glmcheck_1: f64,
    glmcheck_2: f64,
    candle: Option<f64>,
    gguf_py: Option<f64>,
    /// Whether candle's f32 bits equal glmcheck's (`None` without candle).
    same_bits: Option<bool>,
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("dequant bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The whole bench; `Ok(false)` when glmcheck and candle disagree on some type.
fn run() -> Result<bool> {
    let data = tempfile::tempdir()?;
    eprintln!("writing blocks and timing gguf-py ({MIB} MiB of f32 per type)…");
    let gguf_py = gguf_py(data.path())?;
    let pool = |n| rayon::ThreadPoolBuilder::new().num_threads(n).build();
    let (one, two) = (pool(1)?, pool(2)?);
    let n = MIB << 18;
    let write_loop = gbps(&mut vec![0f32; n], plain_writes);
    let mut rows = Vec::new();
    for name in TYPES {
        let ty = GgmlType::from_name(name).context(name)?;
        let path = data.path().join(format!("{name}.blocks"));
        let blocks = std::fs::read(&path).with_context(|| path.display().to_string())?;
        let mut ours = vec![0f32; blocks.len() / ty.type_size() * ty.block_size()];
        let dequant = |out: &mut [f32]| {
            quant::dequantize_rows(ty, &blocks, out, ROW_LEN).expect("whole rows")
        };
        let glmcheck_1 = gbps(&mut ours, |out| one.install(|| dequant(out)));
        let glmcheck_2 = gbps(&mut ours, |out| two.install(|| dequant(out)));
        let candle = candle(ty, &blocks, ours.len());
        let same_bits = candle
            .as_ref()
            .map(|(_, theirs)| same_bits(name, &ours, theirs));
        rows.push(Row {
            ty,
            glmcheck_1,
            glmcheck_2,
            candle: candle.map(|(speed, _)| speed),
            gguf_py: gguf_py.get(name).copied(),
            same_bits,
        });
    }
    report(&rows, write_loop)?;
    Ok(rows.iter().all(|r| r.same_bits != Some(false)))
}

/// The Python with gguf-py: `$GLMCHECK_PYTHON`, else the project's `.venv`.
fn python() -> PathBuf {
    std::env::var_os("GLMCHECK_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python"))
}

/// Write `DIR/TYPE.blocks` for every type and gguf-py's GB/s on them.
fn gguf_py(dir: &Path) -> Result<BTreeMap<String, f64>> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/gguf_py_dequant.py");
    let out = Command::new(python())
        .arg(script)
        .arg(dir)
        .args(TYPES)
        .args(["--mib", &MIB.to_string(), "--reps", &PY_REPS.to_string()])
        .output()
        .context("start python (run scripts/setup-venv or set GLMCHECK_PYTHON)")?;
    if !out.status.success() {
        bail!(
            "gguf_py_dequant.py failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("gguf_py_dequant.py output")
}

/// The best GB/s of f32 written over [`REPS`] runs of `f` filling `out`.
fn gbps(out: &mut [f32], mut f: impl FnMut(&mut [f32])) -> f64 {
    let best = (0..REPS)
        .map(|_| {
            let start = Instant::now();
            f(out);
            start.elapsed()
        })
        .min()
        .unwrap_or(Duration::MAX);
    std::mem::size_of_val(out) as f64 / best.as_secs_f64() / 1e9
}

/// One core storing a constant to every f32 of `out` (vector stores, not a memset): what a
/// dequantizer's stores cost with nothing to decode.
fn plain_writes(out: &mut [f32]) {
    let value = std::hint::black_box(1.5f32);
    out.iter_mut().for_each(|v| *v = value);
    std::hint::black_box(out);
}

/// candle's GB/s and output on `blocks`, if candle has the type.
fn candle(ty: GgmlType, blocks: &[u8], n: usize) -> Option<(f64, Vec<f32>)> {
    Some(match ty {
        GgmlType::Q2_K => candle_run::<BlockQ2K>(blocks, n),
        GgmlType::Q3_K => candle_run::<BlockQ3K>(blocks, n),
        GgmlType::Q4_K => candle_run::<BlockQ4K>(blocks, n),
        GgmlType::Q5_K => candle_run::<BlockQ5K>(blocks, n),
        GgmlType::Q6_K => candle_run::<BlockQ6K>(blocks, n),
        GgmlType::Q4_0 => candle_run::<BlockQ4_0>(blocks, n),
        GgmlType::Q4_1 => candle_run::<BlockQ4_1>(blocks, n),
        GgmlType::Q5_0 => candle_run::<BlockQ5_0>(blocks, n),
        GgmlType::Q5_1 => candle_run::<BlockQ5_1>(blocks, n),
        GgmlType::Q8_0 => candle_run::<BlockQ8_0>(blocks, n),
        _ => return None,
    })
}

/// Time candle's `to_float` (one thread, as candle runs it) into a preallocated output, like
/// glmcheck's; the copy of the bytes into candle's block type is not timed.
fn candle_run<B: k_quants::GgmlType>(bytes: &[u8], n: usize) -> (f64, Vec<f32>) {
    let blocks = candle_blocks::<B>(bytes);
    let mut out = vec![0f32; n];
    let speed = gbps(&mut out, |out| B::to_float(&blocks, out));
    (speed, out)
}

/// The bytes as candle's blocks: `#[repr(C)]` structs of f16 and byte arrays laid out as on
/// disk, so that the bytes are copied in as they are.
fn candle_blocks<B: k_quants::GgmlType>(bytes: &[u8]) -> Vec<B> {
    let size = std::mem::size_of::<B>();
    assert_eq!(
        size,
        B::DTYPE.type_size(),
        "candle's block is its on-disk size"
    );
    assert_eq!(bytes.len() % size, 0, "whole blocks");
    let mut blocks = vec![B::zeros(); bytes.len() / size];
    // SAFETY: `blocks` holds exactly `bytes.len()` bytes, and every bit pattern is a valid block
    // (its fields are f16 and u8 arrays, no padding: the size equals the on-disk block size).
    unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.as_ptr(),
            blocks.as_mut_ptr().cast::<u8>(),
            bytes.len(),
        )
    };
    blocks
}

/// Whether the two outputs are bit-identical; a difference is reported on stderr.
fn same_bits(name: &str, ours: &[f32], theirs: &[f32]) -> bool {
    let differ: Vec<usize> = (0..ours.len())
        .filter(|&i| ours[i].to_bits() != theirs[i].to_bits())
        .collect();
    if let Some(&i) = differ.first() {
        eprintln!(
            "MISMATCH {name}: glmcheck and candle differ in {} of {} values; first at {i}: {} vs {}",
            differ.len(),
            ours.len(),
            ours[i],
            theirs[i]
        );
    }
    differ.is_empty()
}

/// Print the table and write it as Markdown to `bench-results/dequant.md`.
fn report(rows: &[Row], write_loop: f64) -> Result<()> {
    let header = format!(
        "one core's plain f32 write loop: {write_loop:.2} GB/s; outputs of 32 MiB or more \
         leave the decoder with {} stores",
        quant::stores().name()
    );
    println!("{header}");
    println!("{}", table(rows, write_loop, presets::UTF8_FULL_CONDENSED));
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench-results");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("dequant.md");
    let markdown = format!(
        "# Dequantization throughput\n\nGB/s of f32 written, best of {REPS} runs ({PY_REPS} for gguf-py), \
         {MIB} MiB of f32 per type, rows of {ROW_LEN}; {header}.\n\n{}\n",
        table(rows, write_loop, presets::ASCII_MARKDOWN)
    );
    std::fs::write(&path, markdown).with_context(|| path.display().to_string())?;
    println!("wrote {}", path.display());
    Ok(())
}

fn table(rows: &[Row], write_loop: f64, preset: TableStyle) -> Table {
    let mut t = Table::new();
    t.load_style(preset).set_header([
        "type",
        "glmcheck 1 thread",
        "glmcheck 2 threads",
        "candle (1 thread)",
        "glmcheck 1 / candle",
        "glmcheck 1 / write loop",
        "gguf-py numpy",
        "bits equal candle",
    ]);
    let dash = || "—".to_string();
    for r in rows {
        let equal = r.same_bits.map_or_else(dash, |same| {
            if same {
                "yes".into()
            } else {
                "MISMATCH".into()
            }
        });
        t.add_row([
            r.ty.name().to_string(),
            format!("{:.2}", r.glmcheck_1),
            format!("{:.2}", r.glmcheck_2),
            r.candle.map_or_else(dash, |c| format!("{c:.2}")),
            r.candle
                .map_or_else(dash, |c| format!("{:.2}×", r.glmcheck_1 / c)),
            format!("{:.0}%", 100.0 * r.glmcheck_1 / write_loop),
            r.gguf_py.map_or_else(dash, |p| format!("{p:.3}")),
            equal,
        ]);
    }
    t
}

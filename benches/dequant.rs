//! Dequantization throughput, GB/s of f32 written: glmcheck on one and two rayon threads, candle's
//! CPU dequantizer and gguf-py's numpy one, all on the same random valid blocks, and one core's
//! plain f32 write loop over the same output (the ceiling a dequantizer writing f32 works under).
//!
//! `benches/gguf_py_dequant.py` writes the blocks (about 64 MiB of f32 per type) and times gguf-py;
//! this program times the Rust contenders and the write loop in rounds, each round running every
//! one of them once in turn (a shared host's noisy spells then fall on all of them alike, not on
//! one contender's five runs in a row), checks that glmcheck and candle give the same bits,
//! prints the table and writes it as Markdown to `bench-results/dequant.md`.
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
/// Rounds per type; in each, every contender runs once, in turn, so that a noisy spell of a
/// shared host falls on all of them alike; each one's best round counts.
const REPS: usize = 9;
/// Timed runs of gguf-py per type (it is slow, and steadier).
const PY_REPS: usize = 3;

/// One type's results; `None` where a contender lacks the type.
struct Row {
    ty: GgmlType,
    glmcheck_1: f64,
    glmcheck_2: f64,
    candle: Option<f64>,
    /// One core's plain write loop over the same output, in the same rounds.
    write_loop: f64,
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
    let mut rows = Vec::new();
    for name in TYPES {
        let ty = GgmlType::from_name(name).context(name)?;
        let path = data.path().join(format!("{name}.blocks"));
        let blocks = std::fs::read(&path).with_context(|| path.display().to_string())?;
        let n = blocks.len() / ty.type_size() * ty.block_size();
        // Every contender writes the same output, so that none gains from where its pages
        // happen to lie (huge pages or not); each one's values are compared after the rounds.
        let mut out = vec![0f32; n];
        let dequant = |out: &mut [f32]| {
            quant::dequantize_rows(ty, &blocks, out, ROW_LEN).expect("whole rows")
        };
        let mut candle = candle_dequantizer(ty, &blocks);
        let mut best = [Duration::MAX; 4];
        for _ in 0..REPS {
            let took = [
                time(|| one.install(|| dequant(&mut out))),
                time(|| two.install(|| dequant(&mut out))),
                candle
                    .as_mut()
                    .map_or(Duration::MAX, |c| time(|| c(&mut out))),
                time(|| plain_writes(&mut out)),
            ];
            best.iter_mut()
                .zip(took)
                .for_each(|(b, t)| *b = (*b).min(t));
        }
        let gbps = |d: Duration| (n * 4) as f64 / d.as_secs_f64() / 1e9;
        let same_bits = candle.as_mut().map(|c| {
            c(&mut out);
            let theirs = out.clone();
            dequant(&mut out);
            same_bits(name, &out, &theirs)
        });
        rows.push(Row {
            ty,
            glmcheck_1: gbps(best[0]),
            glmcheck_2: gbps(best[1]),
            candle: candle.is_some().then(|| gbps(best[2])),
            write_loop: gbps(best[3]),
            gguf_py: gguf_py.get(name).copied(),
            same_bits,
        });
    }
    report(&rows)?;
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

/// How long `f` takes.
fn time(f: impl FnOnce()) -> Duration {
    let start = Instant::now();
    f();
    start.elapsed()
}

/// One core storing a constant to every f32 of `out` (vector stores, not a memset): what a
/// dequantizer's stores cost with nothing to decode.
fn plain_writes(out: &mut [f32]) {
    let value = std::hint::black_box(1.5f32);
    out.iter_mut().for_each(|v| *v = value);
    std::hint::black_box(out);
}

/// A dequantizer into a preallocated output.
type Dequantizer = Box<dyn FnMut(&mut [f32])>;

/// candle's dequantizer of `blocks` into an output, if candle has the type.
fn candle_dequantizer(ty: GgmlType, blocks: &[u8]) -> Option<Dequantizer> {
    Some(match ty {
        GgmlType::Q2_K => candle_run::<BlockQ2K>(blocks),
        GgmlType::Q3_K => candle_run::<BlockQ3K>(blocks),
        GgmlType::Q4_K => candle_run::<BlockQ4K>(blocks),
        GgmlType::Q5_K => candle_run::<BlockQ5K>(blocks),
        GgmlType::Q6_K => candle_run::<BlockQ6K>(blocks),
        GgmlType::Q4_0 => candle_run::<BlockQ4_0>(blocks),
        GgmlType::Q4_1 => candle_run::<BlockQ4_1>(blocks),
        GgmlType::Q5_0 => candle_run::<BlockQ5_0>(blocks),
        GgmlType::Q5_1 => candle_run::<BlockQ5_1>(blocks),
        GgmlType::Q8_0 => candle_run::<BlockQ8_0>(blocks),
        _ => return None,
    })
}

/// candle's `to_float` (one thread, as candle runs it) into a preallocated output, like
/// glmcheck's; the copy of the bytes into candle's block type is made here, not timed.
fn candle_run<B: k_quants::GgmlType + 'static>(bytes: &[u8]) -> Dequantizer {
    let blocks = candle_blocks::<B>(bytes);
    Box::new(move |out| B::to_float(&blocks, out))
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
fn report(rows: &[Row]) -> Result<()> {
    let header = format!(
        "each type's contenders alternated in every round; outputs of 32 MiB or more leave the \
         decoder with {} stores",
        quant::stores().name()
    );
    println!("{header}");
    println!("{}", table(rows, presets::UTF8_FULL_CONDENSED));
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench-results");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("dequant.md");
    let markdown = format!(
        "# Dequantization throughput\n\nGB/s of f32 written, best of {REPS} rounds ({PY_REPS} runs for \
         gguf-py), {MIB} MiB of f32 per type, rows of {ROW_LEN}; {header}.\n\n{}\n",
        table(rows, presets::ASCII_MARKDOWN)
    );
    std::fs::write(&path, markdown).with_context(|| path.display().to_string())?;
    println!("wrote {}", path.display());
    Ok(())
}

fn table(rows: &[Row], preset: TableStyle) -> Table {
    let mut t = Table::new();
    t.load_style(preset).set_header([
        "type",
        "glmcheck 1 thread",
        "glmcheck 2 threads",
        "candle (1 thread)",
        "glmcheck 1 / candle",
        "write loop (1 core)",
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
            format!("{:.2}", r.write_loop),
            format!("{:.0}%", 100.0 * r.glmcheck_1 / r.write_loop),
            r.gguf_py.map_or_else(dash, |p| format!("{p:.3}")),
            equal,
        ]);
    }
    t
}

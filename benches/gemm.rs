//! The CPU reference's GEMMs for few tokens, GB/s of weights read on one thread: the few-token
//! kernel (`exec::few_tokens`) against the gemm crate's kernels as the forward calls them
//! (`exec::gemm_kernel`), on the shapes a forward hands them: 256 weight rows (one task) of
//! `small`'s and GLM-5's projections (1024 and 6144 features in, and the experts' 512 and 2048),
//! against 1 to 4 tokens (the forward runs the few-token kernel there).
//!
//! Weights come from memory, as an f32 weight's do in a forward: each timed call reads another
//! copy of the rows, out of 512 MiB of copies, each copy twice in all. Or they were just written
//! to one buffer, as a whole task's rows would be once decoded: each copy is first written
//! there, untimed. Or they were written a piece at a time, as the forward decodes a quantized
//! weight's rows for the few-token kernel (`Tokens::piece_rows`): each piece is written just
//! before the kernel reads it, untimed; the last column compares that with gemm on the whole
//! task just decoded, gemm's best case for such weights. The median call counts (the best would
//! favour calls whose rows the prefetchers or L3 happened to hold). Both kernels' outputs are
//! checked to agree within f32 rounding once per shape.
//!
//! Run with `cargo bench --bench gemm`; the table also goes to `bench-results/gemm.md`.

use std::fmt::Write as _;
use std::hint::black_box;
use std::path::Path;
use std::time::Instant;

use anyhow::{ensure, Result};
use comfy_table::{presets, Table};
use glmcheck::exec::cpu::{few_tokens, gemm_kernel};

/// Weight rows per call: the forward's task size.
const ROWS: usize = 256;
/// Features per weight row: `small`'s expert gate/up (hidden 1024) and down (512), GLM-5's
/// (hidden 6144, expert width 2048).
const FEATURES: [usize; 4] = [512, 1024, 2048, 6144];
/// Bytes of weight copies cycled through, well past the last-level cache.
const COPIES_BYTES: usize = 512 << 20;

fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 + seed * 104_729) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

/// Where a call's weight rows are: in memory, as f32 weights of the file are; just written to
/// one buffer, as a quantized weight's rows are once a task has decoded them; or just written
/// a piece of this many rows at a time, as the forward decodes them for the few-token kernel.
#[derive(Clone, Copy, PartialEq)]
enum Rows {
    InMemory,
    JustDecoded,
    DecodedInPieces(usize),
}

/// GB/s of weights of the median call of `kernel` (given rows and their count), over every
/// copy twice. Rows just decoded are first written (untimed) to the one buffer the kernel then
/// reads: the whole call's rows, or each piece's just before the kernel reads that piece.
fn median_rate(
    copies: &[Vec<f32>],
    k: usize,
    rows: Rows,
    mut kernel: impl FnMut(&[f32], usize),
) -> f64 {
    let mut decoded = vec![0f32; copies[0].len()];
    let mut seconds: Vec<f64> = (0..2 * copies.len())
        .map(|call| {
            let w = &copies[call % copies.len()][..];
            let piece = match rows {
                Rows::InMemory => ROWS,
                Rows::JustDecoded => {
                    decoded.copy_from_slice(w);
                    return timed(|| kernel(&decoded, ROWS));
                }
                Rows::DecodedInPieces(piece) => piece,
            };
            let mut spent = 0.0;
            for first in (0..ROWS).step_by(piece) {
                let n = piece.min(ROWS - first);
                let mut part = &w[first * k..(first + n) * k];
                if rows != Rows::InMemory {
                    decoded[..part.len()].copy_from_slice(part);
                    part = &decoded[..part.len()];
                }
                spent += timed(|| kernel(part, n));
            }
            spent
        })
        .collect();
    seconds.sort_by(f64::total_cmp);
    (copies[0].len() * 4) as f64 / seconds[seconds.len() / 2] / 1e9
}

/// Seconds `f` takes.
fn timed(f: impl FnOnce()) -> f64 {
    let began = Instant::now();
    f();
    began.elapsed().as_secs_f64()
}

fn main() -> Result<()> {
    let mut table = Table::new();
    table.load_style(presets::ASCII_MARKDOWN);
    table.set_header([
        "features",
        "tokens",
        "from memory: few-token GB/s",
        "gemm GB/s",
        "ratio",
        "just decoded: few-token GB/s",
        "gemm GB/s",
        "ratio",
        "decoded in pieces: few-token GB/s",
        "/ gemm just decoded",
    ]);
    for k in FEATURES {
        let copies: Vec<Vec<f32>> = (0..COPIES_BYTES / (ROWS * k * 4) + 1)
            .map(|c| values(ROWS * k, c))
            .collect();
        for t in 1..=few_tokens::MAX_TOKENS {
            let x = values(t * k, 7);
            let x_cols: Vec<f32> = (0..k * t).map(|j| x[(j % t) * k + j / t]).collect();
            let gemm = |w: &[f32]| {
                let mut dst = vec![0f32; ROWS * t];
                // SAFETY: dst holds ROWS·t values, x_cols t·k and w ROWS·k.
                let ran = unsafe {
                    gemm_kernel::x_times_weight_rows_f32(
                        t,
                        ROWS,
                        k,
                        dst.as_mut_ptr(),
                        x_cols.as_ptr(),
                        w.as_ptr(),
                    )
                };
                (ran, dst)
            };
            let (ran, want) = gemm(&copies[0]);
            ensure!(ran, "this CPU has no AVX2: gemm_kernel does not run");
            let tokens = few_tokens::Tokens::new(&x, t, k);
            let few_kernel = |w: &[f32], n: usize| {
                let mut dst = vec![0f32; n * t];
                tokens.times_weight_rows(w, n, &mut dst);
                dst
            };
            let got = few_kernel(&copies[0], ROWS);
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
                .fold(0f32, f32::max);
            ensure!(worst < 1e-4, "k {k}, t {t}: the kernels differ by {worst}");
            let mut row = vec![k.to_string(), t.to_string()];
            let mut blocked = 0.0;
            for rows in [Rows::InMemory, Rows::JustDecoded] {
                let few = median_rate(&copies, k, rows, |w, n| {
                    black_box(few_kernel(w, n));
                });
                blocked = median_rate(&copies, k, rows, |w, _| {
                    black_box(gemm(w));
                });
                row.extend([
                    format!("{few:.1}"),
                    format!("{blocked:.1}"),
                    format!("{:.2}×", few / blocked),
                ]);
            }
            let pieces = Rows::DecodedInPieces(tokens.piece_rows());
            let few = median_rate(&copies, k, pieces, |w, n| {
                black_box(few_kernel(w, n));
            });
            row.extend([format!("{few:.1}"), format!("{:.2}×", few / blocked)]);
            table.add_row(row);
        }
    }
    println!("{table}");
    let mut md = String::new();
    writeln!(
        md,
        "Few-token GEMMs, one thread, {ROWS} weight rows from memory or just decoded, the \
         median call (`cargo bench --bench gemm`)\n"
    )?;
    writeln!(md, "{table}")?;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench-results");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("gemm.md"), md)?;
    Ok(())
}

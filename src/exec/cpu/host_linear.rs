//! The CPU backend's linear, `y = x · wᵀ`. The weight's rows go in parallel tasks of a fixed
//! size, each through the `gemm` crate on one thread, or through the few-token kernel for up to
//! four f32 tokens. No task's size depends on the thread count, so every output is the same sum
//! whatever the thread count, and whether the weight is held as values or as blocks that each
//! task decodes.
//!
//! A long prompt's tokens also go in blocks. Each block's activations are transposed into gemm's
//! order, and its outputs back, on a thread of their own: done whole, those transposes left the
//! second core idle for a sixth of a 512-token GEMM. A weight held as values runs each pair of
//! row block and token block as a task of its own. A weight held as blocks decodes a row block
//! once, in one task, for every token block.

use std::ops::Range;

use anyhow::{bail, Context, Result};
use rayon::prelude::*;

use crate::exec::cpu::few_tokens;
use crate::exec::cpu::gemm_kernel;
use crate::exec::cpu::host_weight::HostWeight;
use crate::exec::mat::Mat;
use crate::exec::real::Real;

/// Weight rows per parallel GEMM task.
const WEIGHT_ROWS_PER_TASK: usize = 256;

/// The most tokens in a block of a long prompt. Blocks are of near-equal size, so each block of
/// a longer prompt holds at least half this many tokens. gemm's kernel is chosen by a call's
/// token count, and from 17 up it is the one the whole prompt would get, so blocks leave every
/// sum as it was: an output is its own token's and row's sum, whichever tokens share the call.
const TOKENS_PER_BLOCK: usize = 128;

/// `x · wᵀ` for `x` `[t, in]` and `w` `[out, in]`, accumulated in `E`.
pub fn linear<E: Real>(x: &Mat<E>, w: &HostWeight<E>) -> Result<Mat<E>> {
    let (out, weight_features) = w.shape();
    let (t, features) = (x.rows, x.cols);
    if features != weight_features {
        bail!("linear: input has {features} features, weight expects {weight_features}");
    }
    if t == 0 || out == 0 {
        return Ok(Mat::zeros(t, out));
    }
    // A few f32 tokens go to the kernel for them, which reads them row-major; gemm reads
    // them column-major.
    let few = E::as_f32(x.data())
        .filter(|_| few_tokens::takes(t))
        .map(|x| few_tokens::Tokens::new(x, t, features));
    let blocks = match few {
        Some(_) => std::iter::once(0..t).collect(),
        None => token_blocks(t),
    };
    let x_cols: Vec<Vec<E>> = match few {
        Some(_) => Vec::new(),
        None => blocks
            .par_iter()
            .map(|b| column_major(&x.data()[b.start * features..b.end * features], features))
            .collect(),
    };
    // Each token block's outputs weight row by weight row, `[out, tokens]`.
    let mut outputs: Vec<Vec<E>> = blocks
        .par_iter()
        .map(|b| vec![E::zero(); out * b.len()])
        .collect();
    let split_tokens = matches!(w, HostWeight::Values(_));
    tasks(&blocks, &mut outputs, out, split_tokens)
        .into_par_iter()
        .try_for_each(|task| match &few {
            Some(tokens) => few_token_task(task, w, tokens),
            None => gemm_task(task, w, &x_cols, &blocks),
        })?;
    // Back to row-major, a token block at a time: its rows of `y` are one stretch.
    let mut y = Mat::zeros(t, out);
    let mut rest = y.data_mut();
    let mut rows_of_y = Vec::with_capacity(blocks.len());
    for b in &blocks {
        let (block, tail) = rest.split_at_mut(b.len() * out);
        rows_of_y.push(block);
        rest = tail;
    }
    rows_of_y
        .into_par_iter()
        .zip(outputs.par_iter())
        .for_each(|(y, by_row)| transpose::transpose(by_row, y, by_row.len() / out, out));
    Ok(y)
}

/// `0..t` in blocks of at most [`TOKENS_PER_BLOCK`] tokens, of near-equal size.
fn token_blocks(t: usize) -> Vec<Range<usize>> {
    let n = t.div_ceil(TOKENS_PER_BLOCK).max(1);
    let (size, longer) = (t / n, t % n);
    let mut start = 0;
    (0..n)
        .map(|i| {
            let len = size + usize::from(i < longer);
            start += len;
            start - len..start
        })
        .collect()
}

/// A task: a block of weight rows and, for each token block it covers, that block's index and
/// where its outputs for those rows go (`[rows, tokens]`).
struct Task<'a, E> {
    rows: Range<usize>,
    parts: Vec<(usize, &'a mut [E])>,
}

/// Every block of [`WEIGHT_ROWS_PER_TASK`] weight rows as a task for every token block, or, where
/// `split_tokens` is false, as one task for all of them.
fn tasks<'a, E>(
    blocks: &[Range<usize>],
    outputs: &'a mut [Vec<E>],
    out: usize,
    split_tokens: bool,
) -> Vec<Task<'a, E>> {
    let row_blocks: Vec<Range<usize>> = (0..out)
        .step_by(WEIGHT_ROWS_PER_TASK)
        .map(|start| start..(start + WEIGHT_ROWS_PER_TASK).min(out))
        .collect();
    let mut parts_by_rows: Vec<Vec<(usize, &'a mut [E])>> =
        row_blocks.iter().map(|_| Vec::new()).collect();
    for (b, (by_row, tokens)) in outputs.iter_mut().zip(blocks).enumerate() {
        let chunks = by_row.chunks_mut(WEIGHT_ROWS_PER_TASK * tokens.len());
        for (parts, chunk) in parts_by_rows.iter_mut().zip(chunks) {
            parts.push((b, chunk));
        }
    }
    let mut tasks = Vec::new();
    for (rows, parts) in row_blocks.into_iter().zip(parts_by_rows) {
        if split_tokens {
            tasks.extend(parts.into_iter().map(|part| Task {
                rows: rows.clone(),
                parts: vec![part],
            }));
        } else {
            tasks.push(Task { rows, parts });
        }
    }
    tasks
}

/// A task through gemm: its weight rows (decoded once, where held as blocks) against each of its
/// token blocks.
fn gemm_task<E: Real>(
    task: Task<'_, E>,
    w: &HostWeight<E>,
    x_cols: &[Vec<E>],
    blocks: &[Range<usize>],
) -> Result<()> {
    let n = task.rows.len();
    w.with_rows(task.rows, |w| {
        for (b, dst) in task.parts {
            x_times_weight_rows(&x_cols[b], blocks[b].len(), w, n, dst);
        }
    })
}

/// A task through the few-token kernel. Each output is one row's sum, so the task's rows may
/// go in pieces, each decoded just before the kernel reads it.
fn few_token_task<E: Real>(
    task: Task<'_, E>,
    w: &HostWeight<E>,
    tokens: &few_tokens::Tokens<'_>,
) -> Result<()> {
    let t = tokens.count();
    for (_, dst) in task.parts {
        let dst = E::as_f32_mut(dst).context("few-token GEMM: outputs not in f32")?;
        let start = task.rows.start;
        w.with_row_pieces(task.rows.clone(), tokens.piece_rows(), |piece, w| {
            let w = E::as_f32(w).context("few-token GEMM: weights not in f32")?;
            let first = (piece.start - start) * t;
            tokens.times_weight_rows(w, piece.len(), &mut dst[first..first + piece.len() * t]);
            Ok(())
        })?;
    }
    Ok(())
}

/// `dst = x · w[..rows]ᵀ` for the first `rows` rows of a row-major weight `w` with `k`
/// features and the activations `x_cols` column-major (`[k, t]` row-major: a token's features
/// at stride `t`), `dst` laid out column-major too: `[rows, t]`, a weight row's outputs for
/// every token.
fn x_times_weight_rows<E: Real>(x_cols: &[E], t: usize, w: &[E], rows: usize, dst: &mut [E]) {
    let k = x_cols.len() / t.max(1);
    if t == 0 || rows == 0 {
        return;
    }
    assert!(
        w.len() >= rows * k && x_cols.len() == t * k && dst.len() == t * rows,
        "gemm operands of the wrong size"
    );
    // SAFETY: every operand is column-major, the order gemm's kernel works in: given another,
    // gemm transposes the whole problem or copies the operand into that order on every call (a
    // linear makes one call per block of weight rows), and that copying cost more than the
    // arithmetic. dst is t × rows (column j: weight row j's outputs); lhs is x (t × k); rhs is
    // the block's weight rows read as wᵀ (k × rows, column j is weight row j), in place: the
    // weight is the large operand, and gemm reads a column-contiguous rhs without packing it
    // (on x86, up to 128 × its kernel height of tokens: thousands). The assert bounds every
    // read and write; gemm overwrites dst without reading it. f32 (the reference's type) goes
    // through the per-call kernel choice.
    unsafe {
        if let (Some(x), Some(w), Some(out)) = (E::as_f32(x_cols), E::as_f32(w), E::as_f32_mut(dst))
        {
            if gemm_kernel::x_times_weight_rows_f32(
                t,
                rows,
                k,
                out.as_mut_ptr(),
                x.as_ptr(),
                w.as_ptr(),
            ) {
                return;
            }
        }
        gemm::gemm(
            t,
            rows,
            k,
            dst.as_mut_ptr(),
            t as isize,
            1,
            false,
            x_cols.as_ptr(),
            t as isize,
            1,
            w.as_ptr(),
            k as isize,
            1,
            E::zero(),
            E::one(),
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// `x`'s values (`[rows, cols]` row-major) column by column (`xᵀ` row-major), in cache-sized
/// tiles: element by element, a 64-token prompt's activations took half as long as a task's
/// GEMM on them.
fn column_major<E: Real>(x: &[E], cols: usize) -> Vec<E> {
    let mut out = vec![E::zero(); x.len()];
    transpose::transpose(x, &mut out, cols, x.len() / cols.max(1));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::real::lane_dot::test_values::values;

    /// A prompt of three token blocks gives every output the bits of one gemm call over all its
    /// tokens, for a weight of more than one task's rows and a shared dimension that gemm
    /// splits.
    #[test]
    fn token_blocks_leave_every_sum_as_one_call_gives_it() {
        let (t, k, out) = (300, 1100, 300);
        let x = Mat::new(t, k, values(t * k, 1));
        let w = values(out * k, 2);
        let got = linear(&x, &HostWeight::Values(Mat::new(out, k, w.clone()))).unwrap();
        let x_cols = column_major(x.data(), k);
        let mut by_row = vec![0f32; out * t];
        for (task, dst) in by_row.chunks_mut(WEIGHT_ROWS_PER_TASK * t).enumerate() {
            let first = task * WEIGHT_ROWS_PER_TASK;
            let n = dst.len() / t;
            x_times_weight_rows(&x_cols, t, &w[first * k..(first + n) * k], n, dst);
        }
        let mut want = vec![0f32; t * out];
        transpose::transpose(&by_row, &mut want, t, out);
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(token_blocks(t).len(), 3);
        assert_eq!(bits(got.data()), bits(&want));
    }

    /// Blocks cover the tokens in order, none longer than the most, every one of a prompt past
    /// the most holding at least half of it (gemm's kernel, chosen by a call's tokens, stays
    /// the whole prompt's).
    #[test]
    fn token_blocks_cover_in_near_equal_parts() {
        for t in [1, 2, 17, 127, 128, 129, 200, 256, 257, 511, 512, 2049] {
            let blocks = token_blocks(t);
            assert_eq!(blocks.first().map(|b| b.start), Some(0), "t = {t}");
            assert_eq!(blocks.last().map(|b| b.end), Some(t), "t = {t}");
            for pair in blocks.windows(2) {
                assert_eq!(pair[0].end, pair[1].start, "t = {t}");
            }
            for b in &blocks {
                assert!(b.len() <= TOKENS_PER_BLOCK, "t = {t}: {b:?}");
                if t > TOKENS_PER_BLOCK {
                    assert!(b.len() >= TOKENS_PER_BLOCK / 2, "t = {t}: {b:?}");
                }
            }
        }
    }
}

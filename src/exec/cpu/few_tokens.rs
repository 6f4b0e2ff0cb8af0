//! `x · wᵀ` for a few tokens (a decoding step, a routed expert's handful), bound by reading the
//! weight. gemm broadcasts six weight rows' values at a time against a column of tokens: six
//! strided streams through memory and a load per weight. Here each weight row is read once,
//! contiguously, 16 values at a time, against every token's features, which lie interleaved in
//! L1, or L2 at GLM-5's widths (`benches/gemm.rs` measures the two against each other).
//!
//! Each dot product is summed as [`crate::exec::real::lane_dot`] sums it, the same on every machine (the
//! lanes bound the rounding error too: about a tenth of gemm's single-accumulator sums at 1024
//! features).

use crate::exec::real::lane_dot::{finish, LANES};

/// The most tokens the kernel takes.
pub const MAX_TOKENS: usize = 4;

/// Bytes of decoded weight rows the kernel reads at a time from a task's blocks
/// ([`Tokens::piece_rows`]): decoded just before, they are read from L2, where a whole task's
/// rows (256 of them, 6 MiB at GLM-5's 6144 features) would go out to memory and back.
const PIECE_BYTES: usize = 128 << 10;

/// Pieces are whole multiples of the most rows a kernel takes at a time (AVX-512's eight for one
/// or two tokens), or a piece's rows would go one at a time.
const PIECE_ROWS_MULTIPLE: usize = 8;

/// Whether a GEMM of `t` tokens is this kernel's to run, at any width.
pub fn takes(t: usize) -> bool {
    t <= MAX_TOKENS
}

/// A few tokens' features as the kernel reads them, laid out once for every weight row of a
/// GEMM.
pub struct Tokens<'a> {
    x: &'a [f32],
    /// The widest kernel the CPU runs, and the tokens laid out for it.
    #[cfg(target_arch = "x86_64")]
    interleaved: Option<(Simd, Vec<f32>)>,
    t: usize,
    k: usize,
}

impl<'a> Tokens<'a> {
    /// `t` ≤ [`MAX_TOKENS`] tokens of `k` features, `x` row-major `[t, k]`.
    ///
    /// # Panics
    /// If `t` is more than [`MAX_TOKENS`] or `x` is not `t * k` long.
    pub fn new(x: &'a [f32], t: usize, k: usize) -> Tokens<'a> {
        assert!(
            t <= MAX_TOKENS && x.len() == t * k,
            "few-token GEMM operands of the wrong size"
        );
        Tokens {
            x,
            #[cfg(target_arch = "x86_64")]
            interleaved: Simd::widest().map(|simd| (simd, interleaved(x, t, k))),
            t,
            k,
        }
    }

    /// How many tokens.
    pub fn count(&self) -> usize {
        self.t
    }

    /// Weight rows worth decoding at a time for the kernel: about `PIECE_BYTES` of f32, in
    /// whole blocks of the rows its kernels take at a time (`PIECE_ROWS_MULTIPLE`).
    pub fn piece_rows(&self) -> usize {
        (PIECE_BYTES / 4 / self.k.max(1))
            .max(1)
            .next_multiple_of(PIECE_ROWS_MULTIPLE)
    }

    /// `dst = x · w[..rows]ᵀ`, `w` row-major with at least `rows` rows of `k`, `dst` laid out
    /// column-major: `[rows, t]`, a weight row's outputs for every token. Each output is its
    /// row's sum alone, so rows taken in pieces give the same outputs.
    ///
    /// # Panics
    /// If `w` has fewer than `rows` rows or `dst` does not hold `rows · t` values.
    pub fn times_weight_rows(&self, w: &[f32], rows: usize, dst: &mut [f32]) {
        let (x, t, k) = (self.x, self.t, self.k);
        assert!(
            w.len() >= rows * k && dst.len() == rows * t,
            "few-token GEMM operands of the wrong size"
        );
        #[cfg(target_arch = "x86_64")]
        if let Some((simd, xp)) = &self.interleaved {
            // SAFETY: the CPU has what `simd` names; `new` bounds `x`, the assert above `w`,
            // and `dst` holds `rows * t`.
            unsafe {
                match simd {
                    Simd::Avx512 => avx512::rows(x, xp, t, w, rows, k, dst),
                    Simd::Avx2 => avx2::rows(x, xp, t, w, rows, k, dst),
                }
            }
            return;
        }
        portable_rows(x, t, w, rows, k, dst);
    }
}

/// The instruction sets the kernel has a copy for; both sum in the same sixteen lanes.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum Simd {
    Avx2,
    Avx512,
}

#[cfg(target_arch = "x86_64")]
impl Simd {
    /// The widest this CPU has, if any.
    fn widest() -> Option<Simd> {
        if std::arch::is_x86_feature_detected!("avx512f") {
            Some(Simd::Avx512)
        } else if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            Some(Simd::Avx2)
        } else {
            None
        }
    }
}

/// Rows `0..rows` in blocks of `R`, `whole(first, dst)` each, then `single(first, dst)` for
/// each row left.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn in_row_blocks<const R: usize>(
    rows: usize,
    dst: &mut [f32],
    mut whole: impl FnMut(usize, &mut [f32]),
    mut single: impl FnMut(usize, &mut [f32]),
) {
    let mut first = 0;
    while first + R <= rows {
        whole(first, dst);
        first += R;
    }
    while first < rows {
        single(first, dst);
        first += 1;
    }
}

/// A kernel module's `rows(x, xp, t, w, rows, k, dst)`: `t` tokens against `rows` weight rows
/// of `k` features through the module's `row_block::<T, R>`, compiled for `$features`, `R` rows
/// at a time for one to four tokens (`$r1` … `$r4`), then any rows left one at a time.
#[cfg(target_arch = "x86_64")]
macro_rules! rows_in_blocks {
    ($features:tt, $r1:tt, $r2:tt, $r3:tt, $r4:tt) => {
        /// `x · w[..rows]ᵀ` for `t` tokens into `dst`, `[rows, t]`.
        ///
        /// # Safety
        /// The CPU has `$features`; `x` holds `t * k` values and `xp` them [`interleaved`],
        /// `w` at least `rows * k`, `dst` `rows * t`, `t` ≤ [`MAX_TOKENS`].
        #[target_feature(enable = $features)]
        pub unsafe fn rows(
            x: &[f32],
            xp: &[f32],
            t: usize,
            w: &[f32],
            rows: usize,
            k: usize,
            dst: &mut [f32],
        ) {
            // SAFETY: as this function's.
            unsafe {
                match t {
                    0 => {}
                    1 => rows_by::<1, $r1>(x, xp, w, rows, k, dst),
                    2 => rows_by::<2, $r2>(x, xp, w, rows, k, dst),
                    3 => rows_by::<3, $r3>(x, xp, w, rows, k, dst),
                    _ => rows_by::<MAX_TOKENS, $r4>(x, xp, w, rows, k, dst),
                }
            }
        }

        /// [`rows`] for `T` tokens, `R` rows at a time, then any rows left one at a time.
        ///
        /// # Safety
        /// As [`rows`]'s, with `t` = `T`.
        #[target_feature(enable = $features)]
        unsafe fn rows_by<const T: usize, const R: usize>(
            x: &[f32],
            xp: &[f32],
            w: &[f32],
            rows: usize,
            k: usize,
            dst: &mut [f32],
        ) {
            // SAFETY: as this function's; each block's rows are below `rows`.
            in_row_blocks::<R>(
                rows,
                dst,
                |first, dst| unsafe { row_block::<T, R>(x, xp, w, first, k, dst) },
                |first, dst| unsafe { row_block::<T, 1>(x, xp, w, first, k, dst) },
            );
        }
    };
}

/// The tokens' features chunk by chunk: for each whole chunk of [`LANES`] features, every
/// token's in turn. The kernel reads it front to back instead of one stream per token: token
/// rows lie a multiple of 4 KiB apart at most widths, so per-token streams contend for the same
/// few L1 sets.
#[cfg(target_arch = "x86_64")]
fn interleaved(x: &[f32], t: usize, k: usize) -> Vec<f32> {
    let chunks = k / LANES;
    let mut xp = Vec::with_capacity(chunks * t * LANES);
    for c in 0..chunks {
        for tok in 0..t {
            xp.extend_from_slice(&x[tok * k + c * LANES..][..LANES]);
        }
    }
    xp
}

/// The lanes one value at a time, where the CPU has no AVX2 (`mul_add` is the fused
/// multiply-add, in hardware or not).
fn portable_rows(x: &[f32], t: usize, w: &[f32], rows: usize, k: usize, dst: &mut [f32]) {
    for r in 0..rows {
        for tok in 0..t {
            let lanes = [0f32; LANES];
            dst[r * t + tok] = finish(lanes, &x[tok * k..(tok + 1) * k], &w[r * k..(r + 1) * k]);
        }
    }
}

/// The portable loop's operations, two registers of eight lanes per token and row, the tokens of
/// a row side by side so that the row is read once. A sum's lanes wait on their own fused
/// multiply-adds, so one, two or three tokens take four, two or two rows at a time, to keep
/// eight or more sums in flight (four tokens and two rows would need more registers than AVX2
/// has); every sum is still its own row's, in the same order.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    #[cfg(doc)]
    use super::interleaved;
    use super::{finish, in_row_blocks, LANES, MAX_TOKENS};

    rows_in_blocks!("avx2,fma", 4, 2, 2, 1);

    /// Rows `first..first + R` for `T` tokens.
    ///
    /// # Safety
    /// As [`rows`]'s, with `t` = `T` and `first + R` ≤ the rows `w` and `dst` hold.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn row_block<const T: usize, const R: usize>(
        x: &[f32],
        xp: &[f32],
        w: &[f32],
        first: usize,
        k: usize,
        dst: &mut [f32],
    ) {
        let whole = k - k % LANES;
        let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
        for i in (0..whole).step_by(LANES) {
            for (j, acc) in acc.iter_mut().enumerate() {
                // SAFETY: i + 16 ≤ whole ≤ k, within row `first + j` and within `xp`'s
                // T · whole values.
                unsafe {
                    let row = w.as_ptr().add((first + j) * k + i);
                    let (w0, w1) = (_mm256_loadu_ps(row), _mm256_loadu_ps(row.add(8)));
                    for (tok, acc) in acc.iter_mut().enumerate() {
                        let f = xp.as_ptr().add(i * T + tok * LANES);
                        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(f), w0, acc[0]);
                        acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(f.add(8)), w1, acc[1]);
                    }
                }
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            let r = first + j;
            for (tok, acc) in acc.iter().enumerate() {
                let mut lanes = [0f32; LANES];
                // SAFETY: 16 lanes stored into 16 floats.
                unsafe {
                    _mm256_storeu_ps(lanes.as_mut_ptr(), acc[0]);
                    _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[1]);
                }
                dst[r * T + tok] = finish(
                    lanes,
                    &x[tok * k + whole..(tok + 1) * k],
                    &w[r * k + whole..(r + 1) * k],
                );
            }
        }
    }
}

/// The portable loop's operations, one register of sixteen lanes per token and row: AVX2's sums
/// in half the registers, of which AVX-512 has twice as many, so more rows at a time (eight,
/// eight, four and four for one to four tokens) and eight to sixteen sums in flight.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    #[cfg(doc)]
    use super::interleaved;
    use super::{finish, in_row_blocks, LANES, MAX_TOKENS};

    rows_in_blocks!("avx512f", 8, 8, 4, 4);

    /// Rows `first..first + R` for `T` tokens.
    ///
    /// # Safety
    /// As [`rows`]'s, with `t` = `T` and `first + R` ≤ the rows `w` and `dst` hold.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn row_block<const T: usize, const R: usize>(
        x: &[f32],
        xp: &[f32],
        w: &[f32],
        first: usize,
        k: usize,
        dst: &mut [f32],
    ) {
        let whole = k - k % LANES;
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        for i in (0..whole).step_by(LANES) {
            for (j, acc) in acc.iter_mut().enumerate() {
                // SAFETY: i + 16 ≤ whole ≤ k, within row `first + j` and within `xp`'s
                // T · whole values.
                unsafe {
                    let row = _mm512_loadu_ps(w.as_ptr().add((first + j) * k + i));
                    for (tok, acc) in acc.iter_mut().enumerate() {
                        let f = _mm512_loadu_ps(xp.as_ptr().add(i * T + tok * LANES));
                        *acc = _mm512_fmadd_ps(f, row, *acc);
                    }
                }
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            let r = first + j;
            for (tok, acc) in acc.iter().enumerate() {
                let mut lanes = [0f32; LANES];
                // SAFETY: 16 lanes stored into 16 floats.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *acc) };
                dst[r * T + tok] = finish(
                    lanes,
                    &x[tok * k + whole..(tok + 1) * k],
                    &w[r * k + whole..(r + 1) * k],
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::real::lane_dot::test_values::{near_exact, values};

    /// Every kernel this CPU can run gives the portable loop's bits, at every token count it
    /// takes, with odd rows and features that do not fill the last lanes; and all are within
    /// f32's rounding of f64.
    #[test]
    fn every_path_sums_in_the_same_lanes() {
        let shapes = [
            (1, 1, 0),
            (1, 3, 1),
            (2, 5, 15),
            (3, 7, 16),
            (4, 9, 37),
            (4, 2, 1024),
            (3, 4, 2500),
            (1, 9, 37),
            (1, 8, 1040),
            (2, 7, 100),
            (2, 4, 16),
            (1, 19, 300),
            (2, 9, 48),
            (4, 5, 33),
        ];
        let mut checked = 0;
        for (t, rows, k) in shapes {
            let (x, w) = (values(t * k, 1), values(rows * k + 5, 2));
            let mut want = vec![0.0; rows * t];
            portable_rows(&x, t, &w, rows, k, &mut want);
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let mut dispatched = vec![0.0; rows * t];
            Tokens::new(&x, t, k).times_weight_rows(&w, rows, &mut dispatched);
            let mut paths = vec![("dispatched", dispatched)];
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                let mut got = vec![0.0; rows * t];
                // SAFETY: the CPU has AVX2 and FMA; t ≤ MAX_TOKENS, sizes as it needs.
                unsafe { avx2::rows(&x, &interleaved(&x, t, k), t, &w, rows, k, &mut got) };
                paths.push(("avx2", got));
            }
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx512f") {
                let mut got = vec![0.0; rows * t];
                // SAFETY: the CPU has AVX-512 F; t ≤ MAX_TOKENS, sizes as it needs.
                unsafe { avx512::rows(&x, &interleaved(&x, t, k), t, &w, rows, k, &mut got) };
                paths.push(("avx512", got));
            }
            for (path, got) in &paths {
                assert_eq!(bits(got), bits(&want), "{path}: t {t}, rows {rows}, k {k}");
                checked += 1;
            }
            for r in 0..rows {
                for tok in 0..t {
                    let (x, w) = (&x[tok * k..(tok + 1) * k], &w[r * k..(r + 1) * k]);
                    assert!(near_exact(want[r * t + tok], x, w));
                }
            }
        }
        assert!(
            checked >= shapes.len(),
            "no kernel compared with the portable loop"
        );
    }
}

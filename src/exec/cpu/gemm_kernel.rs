//! The f32 GEMM of the CPU backend's linears, with gemm's kernel chosen per call: its AVX-512
//! kernels where many tokens share each weight row (compute-bound: 1.7–2× its AVX2 kernels at
//! 64 tokens), its AVX2 kernels where few do (a routed expert's handful of tokens: bound by
//! reading the weights, which the AVX2 kernels stream 20–40% faster). The `gemm` crate picks one
//! kernel per process; its crates expose the kernels and the driver both paths share, so this
//! calls the driver with the tables the crate's own dispatch would pass.

use std::sync::OnceLock;

use gemm_common::gemm::gemm_basic_generic;
use gemm_common::simd::{MixedSimd, V3, V4};
use gemm_common::Parallelism;
use gemm_f32::microkernel::avx512f::f32 as wide;
use gemm_f32::microkernel::fma::f32 as narrow;

/// Tokens from which the AVX-512 kernels run: up to 16 the AVX2 kernels take the same time for
/// any token count and beat or tie the AVX-512 ones; from 17 they need a second pass.
pub const WIDE_FROM_TOKENS: usize = 17;

/// f32 values per register of gemm-f32's AVX2 and AVX-512 kernels (private there: 4 × 2 and
/// 8 × 2); the driver's packing must agree with the kernel tables, which the assert checks.
const NARROW_LANES: usize = 8;
const WIDE_LANES: usize = 16;
const _: () = assert!(
    narrow::MR_DIV_N * NARROW_LANES == 16
        && narrow::NR == 6
        && wide::MR_DIV_N * WIDE_LANES == 64
        && wide::NR == 6
);

/// The instruction sets this CPU has, as gemm's proofs of them (a `V3`/`V4` exists only where
/// the CPU has the features its kernels are compiled for).
struct Simd {
    avx2: Option<V3>,
    avx512: Option<V4>,
}

fn simd() -> &'static Simd {
    static SIMD: OnceLock<Simd> = OnceLock::new();
    SIMD.get_or_init(|| Simd {
        avx2: <V3 as MixedSimd<f32, f32, f32, f32>>::try_new(),
        avx512: <V4 as MixedSimd<f32, f32, f32, f32>>::try_new(),
    })
}

/// `dst = x · wᵀ` on one thread for `t` tokens and `rows` weight rows of `k` features, every
/// operand column-major (`dst` is `[rows, t]` row-major: a weight row's outputs for every
/// token; `x_cols` is `[k, t]` row-major; `w` is row-major `[rows, k]`, read in place as
/// `wᵀ`). False where the CPU has neither AVX2 nor AVX-512 (nothing is written).
///
/// # Safety
/// `dst` is valid for `t * rows` writes, `x_cols` for `t * k` reads and `w` for `rows * k`
/// reads, and `dst` overlaps neither.
pub unsafe fn x_times_weight_rows_f32(
    t: usize,
    rows: usize,
    k: usize,
    dst: *mut f32,
    x_cols: *const f32,
    w: *const f32,
) -> bool {
    let (tokens, k_stride) = (t as isize, k as isize);
    // gemm's own driver as its dispatch calls it, after its stride normalisation, which leaves
    // this layout as it is (every stride positive, the output's columns no closer than its
    // rows): `$simd`'s kernels `$kernels`, registers of `$lanes` values.
    macro_rules! driver {
        ($simd:ident, $proof:expr, $lanes:expr, $kernels:ident) => {
            gemm_basic_generic::<
                $simd,
                f32,
                $lanes,
                { $kernels::MR_DIV_N * $lanes },
                { $kernels::NR },
                { $kernels::MR_DIV_N },
                { $kernels::H_M },
                { $kernels::H_N },
            >(
                $proof,
                t,
                rows,
                k,
                dst,
                tokens,
                1,
                false,
                x_cols,
                tokens,
                1,
                w,
                k_stride,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                |a, b, c| a * b + c,
                &$kernels::UKR,
                &$kernels::H_UKR,
                false,
                Parallelism::None,
            )
        };
    }
    let s = simd();
    // SAFETY: the caller's bounds; a V3/V4 proves the CPU runs its kernels.
    unsafe {
        match (s.avx512, s.avx2) {
            (Some(v4), _) if t >= WIDE_FROM_TOKENS => driver!(V4, v4, WIDE_LANES, wide),
            (_, Some(v3)) => driver!(V3, v3, NARROW_LANES, narrow),
            // Neither: the caller's own call to gemm (its scalar kernels).
            _ => return false,
        }
    }
    true
}

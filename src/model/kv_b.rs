//! `kv_b_proj` and llama.cpp's split form.
//!
//! `kv_b_proj` is head-major: for head h, rows `h·(nope+v) .. +nope` are `W_UK[h]`
//! (`[nope, kv_lora]`) and the next `v` rows are `W_UV[h]` (`[v, kv_lora]`). llama.cpp's
//! converter stores `attn_k_b[h] = W_UK[h]ᵀ` (`[heads, kv_lora, nope]`) and
//! `attn_v_b[h] = W_UV[h]` (`[heads, v, kv_lora]`).
//! A 2-D "folded" split tensor holds the same bytes with the head dimension merged, so both
//! forms are assembled by the same code.

use rayon::prelude::*;

/// Dimensions of the MLA up-projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvBDims {
    pub heads: usize,
    pub kv_lora: usize,
    pub nope: usize,
    pub v: usize,
}

impl KvBDims {
    fn rows_per_head(&self) -> usize {
        self.nope + self.v
    }

    pub fn kv_b_len(&self) -> usize {
        self.heads * self.rows_per_head() * self.kv_lora
    }

    pub fn k_b_len(&self) -> usize {
        self.heads * self.kv_lora * self.nope
    }

    pub fn v_b_len(&self) -> usize {
        self.heads * self.v * self.kv_lora
    }
}

/// Why the split tensors cannot be assembled.
#[derive(Debug, PartialEq, Eq)]
pub struct KvBSizeError {
    pub part: &'static str,
    pub got: usize,
    pub expected: usize,
    pub dims: KvBDims,
}

impl std::fmt::Display for KvBSizeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = &self.dims;
        let per_head = match self.part {
            "attn_k_b" => format!("kv_lora {} × nope {}", d.kv_lora, d.nope),
            "attn_v_b" => format!("v {} × kv_lora {}", d.v, d.kv_lora),
            _ => format!("(nope {} + v {}) × kv_lora {}", d.nope, d.v, d.kv_lora),
        };
        write!(
            f,
            "{} holds {} values; {} heads of {per_head} are {}",
            self.part, self.got, d.heads, self.expected
        )
    }
}

impl std::error::Error for KvBSizeError {}

fn check_len(
    part: &'static str,
    got: usize,
    expected: usize,
    dims: KvBDims,
) -> Result<(), KvBSizeError> {
    if got == expected {
        Ok(())
    } else {
        Err(KvBSizeError {
            part,
            got,
            expected,
            dims,
        })
    }
}

/// Rebuild `kv_b_proj` (row-major `[heads·(nope+v), kv_lora]`) from `attn_k_b` and `attn_v_b`:
/// the exact inverse of llama.cpp's split, one head at a time.
pub fn assemble_kv_b(k_b: &[f32], v_b: &[f32], d: KvBDims) -> Result<Vec<f32>, KvBSizeError> {
    check_len("attn_k_b", k_b.len(), d.k_b_len(), d)?;
    check_len("attn_v_b", v_b.len(), d.v_b_len(), d)?;
    assemble_kv_b_by_heads(d, |h, k_head, uv| {
        k_head.copy_from_slice(&k_b[h * k_head.len()..][..k_head.len()]);
        uv.copy_from_slice(&v_b[h * uv.len()..][..uv.len()]);
        Ok(())
    })
}

/// `kv_b_proj` assembled head by head, the heads in parallel: `fill(h, k_head, uv)` writes head
/// h's `attn_k_b` (`[kv_lora, nope]`) into `k_head`, which is then transposed into place, and its
/// `attn_v_b` (`[v, kv_lora]`) straight into its place `uv`; so that no part is held whole
/// beside the result (GLM-5's are 57 MB of f32 a layer).
pub fn assemble_kv_b_by_heads<E: Send>(
    d: KvBDims,
    fill: impl Fn(usize, &mut [f32], &mut [f32]) -> Result<(), E> + Sync,
) -> Result<Vec<f32>, E> {
    let mut out = vec![0f32; d.kv_b_len()];
    if out.is_empty() {
        return Ok(out);
    }
    out.par_chunks_exact_mut(d.rows_per_head() * d.kv_lora)
        .enumerate()
        .try_for_each_init(
            || vec![0f32; d.kv_lora * d.nope],
            |k_head, (h, head_out)| {
                let (uk, uv) = head_out.split_at_mut(d.nope * d.kv_lora);
                fill(h, k_head, uv)?;
                // uk[i][c] = k_head[c][i]: undo the per-head transpose.
                for (c, k_row) in k_head.chunks_exact(d.nope.max(1)).enumerate() {
                    for (i, &x) in k_row.iter().enumerate() {
                        uk[i * d.kv_lora + c] = x;
                    }
                }
                Ok(())
            },
        )?;
    Ok(out)
}

/// Split `kv_b_proj` the way llama.cpp's converter does: `(attn_k_b, attn_v_b)`.
pub fn split_kv_b(kv_b: &[f32], d: KvBDims) -> Result<(Vec<f32>, Vec<f32>), KvBSizeError> {
    check_len("kv_b_proj", kv_b.len(), d.kv_b_len(), d)?;
    let mut k_b = vec![0f32; d.k_b_len()];
    let mut v_b = Vec::with_capacity(d.v_b_len());
    for (h, head) in kv_b.chunks_exact(d.rows_per_head() * d.kv_lora).enumerate() {
        let (uk, uv) = head.split_at(d.nope * d.kv_lora);
        let k_head = &mut k_b[h * d.kv_lora * d.nope..][..d.kv_lora * d.nope];
        for (i, uk_row) in uk.chunks_exact(d.kv_lora).enumerate() {
            for (c, &x) in uk_row.iter().enumerate() {
                k_head[c * d.nope + i] = x;
            }
        }
        v_b.extend_from_slice(uv);
    }
    Ok((k_b, v_b))
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: KvBDims = KvBDims {
        heads: 3,
        kv_lora: 5,
        nope: 2,
        v: 4,
    };

    fn ramp(n: usize) -> Vec<f32> {
        (0..n).map(|i| i as f32).collect()
    }

    #[test]
    fn split_then_assemble_is_identity() {
        let kv_b = ramp(D.kv_b_len());
        let (k, v) = split_kv_b(&kv_b, D).unwrap();
        assert_eq!(assemble_kv_b(&k, &v, D).unwrap(), kv_b);
    }

    #[test]
    fn k_b_is_transposed_per_head() {
        // Row r of head h's W_UK block, column c, lands at k_b[h][c][r].
        let kv_b = ramp(D.kv_b_len());
        let (k, v) = split_kv_b(&kv_b, D).unwrap();
        let (h, r, c) = (1, 1, 3);
        assert_eq!(
            k[h * D.kv_lora * D.nope + c * D.nope + r],
            kv_b[(h * (D.nope + D.v) + r) * D.kv_lora + c]
        );
        assert_eq!(v[0], kv_b[D.nope * D.kv_lora]);
    }

    #[test]
    fn sizes_are_checked() {
        let (k, v) = split_kv_b(&ramp(D.kv_b_len()), D).unwrap();
        assert!(assemble_kv_b(&k[1..], &v, D).is_err());
    }
}

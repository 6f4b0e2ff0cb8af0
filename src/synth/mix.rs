//! Which type each tensor gets in a whole-model mix, as llama.cpp's quantizer chooses, plus
//! `--quant GLOB=TYPE` overrides.

use globset::{Glob, GlobMatcher};

use crate::model::config::Glm5Config;
use crate::weights::fp8::ScaleFmt;
use crate::weights::quantize::fallback;
use crate::weights::GgmlType;

/// A storage recipe for a whole model, named after the GGUF files people download.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mix {
    /// Everything F32.
    F32,
    /// `convert_hf_to_gguf.py --outtype bf16`: matrices BF16.
    Bf16,
    /// `--outtype q8_0`: matrices Q8_0.
    Q8_0,
    /// `llama-quantize … Q4_K_M`.
    Q4KM,
    /// An Unsloth-"UD"-like dynamic mix, but only of types [`crate::weights::quantize::quantize`] can make, so that
    /// the weights stay close to their f32 values: routed experts IQ4_XS, shared experts Q8_0,
    /// attention (and the DSA indexer) Q6_K on the "more bits" layers of Q4_K_M and Q5_K
    /// elsewhere, embeddings Q4_K, output Q6_K, everything else (dense FFN, MTP projection) Q6_K.
    UdIq,
    /// GLM-5-FP8's Hugging Face layout: linear weights FP8 E4M3 with a float32
    /// `weight_scale_inv` per 128×128 block, the rest BF16. Not a GGUF mix.
    Fp8,
    /// DeepSeek-V3.1's: [`Mix::Fp8`] with every scale a power of two (UE8M0, still stored as
    /// float32) and `scale_fmt: "ue8m0"` in the config.
    Fp8Ue8m0,
}

impl Mix {
    /// The `--quant` names, in declaration order.
    const NAMES: [(Mix, &'static str); 7] = [
        (Mix::F32, "f32"),
        (Mix::Bf16, "bf16"),
        (Mix::Q8_0, "q8_0"),
        (Mix::Q4KM, "q4_k_m"),
        (Mix::UdIq, "ud-iq"),
        (Mix::Fp8, "fp8"),
        (Mix::Fp8Ue8m0, "fp8-ue8m0"),
    ];

    /// The block scales' format of an FP8 mix; `None` for the others.
    pub fn fp8_scales(self) -> Option<ScaleFmt> {
        match self {
            Mix::Fp8 => Some(ScaleFmt::Float),
            Mix::Fp8Ue8m0 => Some(ScaleFmt::Ue8m0),
            _ => None,
        }
    }

    /// llama.cpp's `general.file_type` (`LLAMA_FTYPE_*`) of a file of this mix, as its
    /// converter and quantizer record it.
    pub fn file_type(self) -> u32 {
        match self {
            Mix::F32 => 0,
            Mix::Q8_0 => 7,
            Mix::Q4KM => 15,
            Mix::UdIq => 30,
            // `write_gguf` refuses the FP8 mixes (Hugging Face layouts) before asking.
            Mix::Bf16 | Mix::Fp8 | Mix::Fp8Ue8m0 => 32,
        }
    }
}

impl std::fmt::Display for Mix {
    /// The `--quant` name.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = Mix::NAMES
            .iter()
            .find(|(m, _)| m == self)
            .map_or("?", |&(_, n)| n);
        f.write_str(name)
    }
}

impl std::str::FromStr for Mix {
    type Err = String;

    /// `f32`, `bf16`, `q8_0`, `q4_k_m`, `ud-iq`, `fp8` or `fp8-ue8m0`, in any case.
    fn from_str(s: &str) -> Result<Self, String> {
        Mix::NAMES
            .iter()
            .find(|(_, n)| n.eq_ignore_ascii_case(s))
            .map(|&(m, _)| m)
            .ok_or_else(|| {
                let names: Vec<&str> = Mix::NAMES.iter().map(|&(_, n)| n).collect();
                format!("unknown mix {s:?} (one of {})", names.join(", "))
            })
    }
}

/// A `--quant GLOB=TYPE` override.
pub type Override = (GlobMatcher, GgmlType);

/// A `--quant GLOB=TYPE` override that could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("bad --quant override {spec:?}: {why}")]
pub struct OverrideError {
    pub spec: String,
    pub why: String,
}

/// The type of tensor `name` (GGUF name, row length `row_len`, `n_dims` dimensions) in `mix`, for
/// a model of `n_layers` blocks (`block_count`, MTP layers included).
///
/// Tensors llama.cpp never quantizes stay F32: 1-D ones (norms, biases, `exp_probs_b`) and the
/// router `ffn_gate_inp`. For Q4_K_M this follows `llama_tensor_get_type`: Q4_K by default,
/// `output.weight` Q6_K (Q8_0 if its rows are not whole 256-blocks), and `attn_v`/`ffn_down`
/// (with `ffn_down_exps` and `ffn_down_shexp`) Q6_K on the layers `use_more_bits` picks. Two
/// simplifications: llama.cpp counts `attn_v` tensors in file order where we take the layer from
/// the name (the same for one per layer), and the MLA halves `attn_k_b`/`attn_v_b` are treated
/// like `attn_k`/`attn_v` (so `attn_v_b` gets the more-bits rule). Finally [`fallback`] applies.
pub fn mix_type(mix: Mix, name: &str, row_len: u64, n_dims: usize, n_layers: u64) -> GgmlType {
    if n_dims < 2 || name.contains("ffn_gate_inp") || name.contains("exp_probs_b") {
        return GgmlType::F32;
    }
    let more_bits = || layer_of(name).is_some_and(|i| use_more_bits(i, n_layers));
    let ty = match mix {
        Mix::F32 => GgmlType::F32,
        Mix::Bf16 | Mix::Fp8 | Mix::Fp8Ue8m0 => GgmlType::BF16,
        Mix::Q8_0 => GgmlType::Q8_0,
        Mix::Q4KM => {
            if name == "output.weight" {
                if row_len.is_multiple_of(256) {
                    GgmlType::Q6_K
                } else {
                    GgmlType::Q8_0
                }
            } else if (name.contains("attn_v.")
                || name.contains("attn_v_b.")
                || name.contains("ffn_down"))
                && more_bits()
            {
                GgmlType::Q6_K
            } else {
                GgmlType::Q4_K
            }
        }
        Mix::UdIq => {
            if name == "token_embd.weight" {
                GgmlType::Q4_K
            } else if name.contains("_exps.") {
                GgmlType::IQ4_XS
            } else if name.contains("_shexp.") {
                GgmlType::Q8_0
            } else if (name.contains(".attn_") || name.contains(".indexer.")) && !more_bits() {
                GgmlType::Q5_K
            } else {
                GgmlType::Q6_K
            }
        }
    };
    fallback(ty, row_len)
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers and every third between.
fn use_more_bits(i: u64, n: u64) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The layer of a `blk.N.…` name.
fn layer_of(name: &str) -> Option<u64> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// Parse `GLOB=TYPE` (the last `=` splits), e.g. `blk.*.ffn_down_exps.weight=Q6_K`. The type must
/// be one glmcheck can write: quantized, or made of random blocks.
pub fn parse_override(spec: &str) -> Result<Override, OverrideError> {
    let bad = |why: String| OverrideError {
        spec: spec.to_string(),
        why,
    };
    let (glob, ty) = spec
        .rsplit_once('=')
        .ok_or_else(|| bad("expected GLOB=TYPE".into()))?;
    let ty = GgmlType::from_name(ty).ok_or_else(|| bad(format!("unknown type {ty:?}")))?;
    if !ty.can_dequantize() {
        return Err(bad(format!("{ty} cannot be dequantized")));
    }
    let glob = Glob::new(glob).map_err(|e| bad(e.to_string()))?;
    Ok((glob.compile_matcher(), ty))
}

/// The type of GGUF tensor `name` of row-major `shape` in a model of `cfg`: the first matching
/// override's type (through [`fallback`], so rows stay whole blocks), else [`mix_type`].
pub fn choose_type(
    mix: Mix,
    overrides: &[Override],
    name: &str,
    shape: &[u64],
    cfg: &Glm5Config,
) -> GgmlType {
    let row_len = shape.last().copied().unwrap_or(1);
    match overrides.iter().find(|(glob, _)| glob.is_match(name)) {
        Some(&(_, ty)) => fallback(ty, row_len),
        None => {
            let n_layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers;
            mix_type(mix, name, row_len, shape.len(), n_layers)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use GgmlType as T;

    #[test]
    fn q4_k_m_choices() {
        // 79 blocks (78 + MTP): more bits below 9, from 69 on, and at 9 + 2, 9 + 5, ….
        let t = |name: &str, row: u64| mix_type(Mix::Q4KM, name, row, 2, 79);
        assert_eq!(t("token_embd.weight", 6144), T::Q4_K);
        assert_eq!(t("output.weight", 6144), T::Q6_K);
        assert_eq!(t("output.weight", 6016), T::Q8_0);
        assert_eq!(t("blk.0.attn_v_b.weight", 512), T::Q6_K);
        assert_eq!(t("blk.9.attn_v_b.weight", 512), T::Q4_K);
        assert_eq!(t("blk.11.attn_v_b.weight", 512), T::Q6_K);
        assert_eq!(t("blk.12.ffn_down_exps.weight", 2048), T::Q4_K);
        assert_eq!(t("blk.14.ffn_down_exps.weight", 2048), T::Q6_K);
        assert_eq!(t("blk.75.ffn_down_shexp.weight", 2048), T::Q6_K);
        assert_eq!(t("blk.0.ffn_down.weight", 12288), T::Q6_K);
        assert_eq!(t("blk.14.ffn_up_exps.weight", 6144), T::Q4_K);
        assert_eq!(t("blk.3.attn_k_b.weight", 192), T::Q5_0);
        assert_eq!(t("blk.3.attn_q_b.weight", 2048), T::Q4_K);
        assert_eq!(t("blk.3.ffn_gate_inp.weight", 6144), T::F32);
        assert_eq!(
            mix_type(Mix::Q4KM, "blk.3.attn_norm.weight", 6144, 1, 79),
            T::F32
        );
        assert_eq!(
            mix_type(Mix::Q4KM, "blk.3.exp_probs_b.bias", 256, 1, 79),
            T::F32
        );
    }

    #[test]
    fn other_mixes() {
        let t = |mix, name: &str, row: u64| mix_type(mix, name, row, 2, 79);
        assert_eq!(t(Mix::F32, "blk.3.attn_q_b.weight", 2048), T::F32);
        assert_eq!(t(Mix::Bf16, "blk.3.attn_q_b.weight", 2048), T::BF16);
        assert_eq!(t(Mix::Q8_0, "blk.3.attn_q_b.weight", 2048), T::Q8_0);
        assert_eq!(t(Mix::Q8_0, "blk.3.attn_q_b.weight", 100), T::F16);
        assert_eq!(t(Mix::UdIq, "blk.5.ffn_gate_exps.weight", 6144), T::IQ4_XS);
        assert_eq!(t(Mix::UdIq, "blk.5.ffn_down_exps.weight", 2048), T::IQ4_XS);
        assert_eq!(t(Mix::UdIq, "blk.5.ffn_up_shexp.weight", 6144), T::Q8_0);
        assert_eq!(t(Mix::UdIq, "blk.5.attn_q_b.weight", 2048), T::Q6_K);
        assert_eq!(t(Mix::UdIq, "blk.9.attn_q_b.weight", 2048), T::Q5_K);
        assert_eq!(t(Mix::UdIq, "token_embd.weight", 6144), T::Q4_K);
        assert_eq!(t(Mix::UdIq, "output.weight", 6144), T::Q6_K);
    }

    #[test]
    fn mix_names() {
        assert_eq!("Q4_K_M".parse(), Ok(Mix::Q4KM));
        assert_eq!("ud-iq".parse(), Ok(Mix::UdIq));
        assert_eq!("FP8-UE8M0".parse(), Ok(Mix::Fp8Ue8m0));
        assert_eq!(Mix::Fp8Ue8m0.to_string(), "fp8-ue8m0");
        assert!("q4".parse::<Mix>().is_err());
    }

    #[test]
    fn overrides_first_match_wins() {
        let o = [
            parse_override("blk.1.*=Q8_0").expect("valid"),
            parse_override("blk.*_exps.weight=Q2_K").expect("valid"),
        ];
        let cfg = Glm5Config::glm5();
        let t = |name: &str, row| choose_type(Mix::Q4KM, &o, name, &[4, row], &cfg);
        assert_eq!(t("blk.1.ffn_up_exps.weight", 6144), T::Q8_0);
        assert_eq!(t("blk.2.ffn_up_exps.weight", 6144), T::Q2_K);
        assert_eq!(t("blk.2.ffn_up_exps.weight", 192), T::IQ4_NL);
        assert_eq!(t("blk.2.attn_q_b.weight", 2048), T::Q4_K);
        assert_eq!(t("blk.2.attn_v_b.weight", 512), T::Q6_K);
        assert_eq!(
            choose_type(Mix::Q4KM, &o, "blk.3.attn_norm.weight", &[6144], &cfg),
            T::F32
        );
        for bad in ["Q4_K", "x=Q9_K", "x=I32", "a[=Q4_K"] {
            assert!(parse_override(bad).is_err(), "{bad}");
        }
    }
}

//! The MLA/MoE family: GLM-5 and the published models built from the same blocks (MLA
//! attention, sigmoid- or softmax-routed MoE with shared experts, optionally a DSA indexer).
//! One forward runs them all; a [`Member`] names which one a config describes and supplies
//! the defaults its own config class gives a missing key.

use serde::{Deserialize, Serialize};

/// A published model of the family, by the `model_type` of its `config.json`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Member {
    /// GLM-5 / 5.1 / 5.2 (`glm_moe_dsa`): MLA with a DSA indexer, one expert group.
    #[default]
    #[serde(rename = "glm_moe_dsa")]
    Glm5,
    /// GLM-4.7-Flash (`glm4_moe_lite`): GLM-5 without the indexer.
    #[serde(rename = "glm4_moe_lite")]
    Glm47Flash,
    /// DeepSeek-V2 / V2.5 / V2-Lite (`deepseek_v2`): softmax routing without a bias, greedy or
    /// group-limited by each group's best score; V2-Lite has no q LoRA.
    #[serde(rename = "deepseek_v2")]
    DeepseekV2,
    /// DeepSeek-V3 / R1 / V3.1 (`deepseek_v3`): sigmoid routing with a correction bias, eight
    /// groups of which four compete, YaRN.
    #[serde(rename = "deepseek_v3")]
    DeepseekV3,
    /// DeepSeek-V3.2 (`deepseek_v32`): V3 with a DSA indexer that rotates NeoX halves.
    #[serde(rename = "deepseek_v32")]
    DeepseekV32,
    /// Kimi-K2 (`kimi_k2`): the DeepSeek-V3 class with 384 experts in one group.
    #[serde(rename = "kimi_k2")]
    KimiK2,
}

/// How the router picks a token's experts (transformers' and DeepSeek's `topk_method`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TopkMethod {
    /// The best `k` scores.
    Greedy,
    /// Only the `topk_group` groups with the best single score compete (DeepSeek-V2).
    GroupLimitedGreedy,
    /// Scores plus the correction bias choose; a group's score is the sum of its two best
    /// (DeepSeek-V3, GLM): the only method with a bias tensor.
    #[default]
    NoauxTc,
}

impl TopkMethod {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "greedy" => Self::Greedy,
            "group_limited_greedy" => Self::GroupLimitedGreedy,
            "noaux_tc" => Self::NoauxTc,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Greedy => "greedy",
            Self::GroupLimitedGreedy => "group_limited_greedy",
            Self::NoauxTc => "noaux_tc",
        }
    }

    /// Whether the router stores `e_score_correction_bias` (`exp_probs_b`).
    pub fn has_bias(self) -> bool {
        self == Self::NoauxTc
    }
}

impl Member {
    pub const ALL: [Member; 6] = [
        Member::Glm5,
        Member::Glm47Flash,
        Member::DeepseekV2,
        Member::DeepseekV3,
        Member::DeepseekV32,
        Member::KimiK2,
    ];

    /// The `model_type` of its `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Member::Glm5 => "glm_moe_dsa",
            Member::Glm47Flash => "glm4_moe_lite",
            Member::DeepseekV2 => "deepseek_v2",
            Member::DeepseekV3 => "deepseek_v3",
            Member::DeepseekV32 => "deepseek_v32",
            Member::KimiK2 => "kimi_k2",
        }
    }

    pub fn from_model_type(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.model_type() == s)
    }

    /// What people call it.
    pub fn name(self) -> &'static str {
        match self {
            Member::Glm5 => "GLM-5",
            Member::Glm47Flash => "GLM-4.7-Flash",
            Member::DeepseekV2 => "DeepSeek-V2",
            Member::DeepseekV3 => "DeepSeek-V3",
            Member::DeepseekV32 => "DeepSeek-V3.2",
            Member::KimiK2 => "Kimi-K2",
        }
    }

    /// The transformers class that runs it (Kimi-K2 ships DeepSeek-V3's).
    pub fn architecture(self) -> &'static str {
        match self {
            Member::Glm5 => "GlmMoeDsaForCausalLM",
            Member::Glm47Flash => "Glm4MoeLiteForCausalLM",
            Member::DeepseekV2 => "DeepseekV2ForCausalLM",
            Member::DeepseekV3 | Member::KimiK2 => "DeepseekV3ForCausalLM",
            Member::DeepseekV32 => "DeepseekV32ForCausalLM",
        }
    }

    /// llama.cpp's GGUF architecture for it: every member but GLM-5 and V3.2 converts to
    /// `deepseek2`.
    pub fn gguf_arch(self) -> &'static str {
        match self {
            Member::Glm5 => "glm-dsa",
            Member::DeepseekV32 => "deepseek32",
            _ => "deepseek2",
        }
    }

    /// The member a GGUF describes: its architecture, and for `deepseek2` (which several
    /// members share) the converter's tokenizer (`glm4`, `kimi-k2`, `deepseek-v3`,
    /// `deepseek-llm`) or model name, else the gating (softmax: V2). Only naming depends on it:
    /// the forward reads the metadata.
    pub fn from_gguf(
        arch: &str,
        pre: Option<&str>,
        name: Option<&str>,
        softmax: bool,
    ) -> Option<Self> {
        let name = name.unwrap_or_default().to_ascii_lowercase();
        Some(match arch {
            "glm-dsa" => Member::Glm5,
            "deepseek32" => Member::DeepseekV32,
            "deepseek2" => match pre {
                Some("glm4") => Member::Glm47Flash,
                Some("kimi-k2") => Member::KimiK2,
                // The converter's names for DeepSeek-V3's and DeepSeek-V2's own tokenizers: the
                // gating says less (a V3 file whose gating key went missing reads as softmax).
                Some("deepseek-v3") => Member::DeepseekV3,
                Some("deepseek-llm") => Member::DeepseekV2,
                _ if name.contains("glm-4") || name.contains("glm4") => Member::Glm47Flash,
                _ if name.contains("kimi") => Member::KimiK2,
                _ if softmax => Member::DeepseekV2,
                _ => Member::DeepseekV3,
            },
            _ => return None,
        })
    }

    /// Whether attention carries the DSA indexer.
    pub fn has_indexer(self) -> bool {
        matches!(self, Member::Glm5 | Member::DeepseekV32)
    }
}

/// The routing scores llama.cpp's loader gives a GGUF of `arch` without `expert_gating_func`:
/// glm-dsa's and deepseek32's sigmoid; deepseek2's softmax (its V2/V2.5 files predate the key),
/// except for a file shaped as GLM-4.7-Flash (47 or 48 layers past the MTP ones, vocabulary
/// 154880), which it takes for sigmoid. Any other deepseek2 sigmoid model without the key runs
/// softmax there.
pub fn llama_cpp_default_gating(arch: &str, layers: u64, vocab: u64) -> &'static str {
    let glm_4_7_flash = matches!(layers, 47 | 48) && vocab == 154880;
    match arch == "deepseek2" && !glm_4_7_flash {
        true => "softmax",
        false => "sigmoid",
    }
}

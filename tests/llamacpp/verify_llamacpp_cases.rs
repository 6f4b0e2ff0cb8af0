//! The cases of `verify_llamacpp`: the honest files llama.cpp's tools make, and the faults planted
//! in their stored bytes by `glmcheck_oracle.formats.plant_gguf_fault`, each with the names
//! `glmcheck verify` (class, relation) and `glmcheck bisect` (class) must give it.

/// The honest files, by the keys of `llamacpp.quants`' JSON.
pub(crate) const HONEST: [&str; 7] = [
    "f32",
    "q8_0",
    "q6_k",
    "q4_k_m",
    "iq4_xs",
    "q4_k_m-imatrix",
    "q4_k_m-split",
];

/// One planted fault: the file it goes into, `formats.plant_gguf_fault`'s FAULT, TENSOR and
/// ARGS, and what verify (class, relation) and bisect (class) must call it.
pub(crate) struct Fault {
    pub(crate) file: &'static str,
    pub(crate) fault: &'static str,
    pub(crate) tensor: &'static str,
    pub(crate) args: &'static [&'static str],
    pub(crate) class: &'static str,
    pub(crate) relation: &'static str,
    /// Also run with the F32 GGUF as the reference.
    pub(crate) gguf_reference: bool,
}

const fn fault(
    file: &'static str,
    fault: &'static str,
    tensor: &'static str,
    args: &'static [&'static str],
    class: &'static str,
    relation: &'static str,
) -> Fault {
    Fault {
        file,
        fault,
        tensor,
        args,
        class,
        relation,
        gguf_reference: false,
    }
}

pub(crate) const FAULTS: [Fault; 19] = [
    Fault {
        gguf_reference: true,
        ..fault(
            "q4_k_m",
            "swap-experts",
            "blk.1.ffn_down_exps.weight",
            &["1", "5"],
            "weight_layout",
            "expert_permutation",
        )
    },
    fault(
        "q4_k_m",
        "scale",
        "blk.2.attn_output.weight",
        &["2"],
        "scale_mismatch",
        "scalar_multiple",
    ),
    fault(
        "q4_k_m",
        "swap-heads",
        "blk.0.attn_k_b.weight",
        &["0", "3"],
        "weight_layout",
        "head_permutation",
    ),
    // Row 7's only block (its rows are 256 long).
    fault(
        "q4_k_m",
        "zero-blocks",
        "blk.1.attn_q_b.weight",
        &["7", "0", "1"],
        "corrupt_weight",
        "zeros",
    ),
    // Row 44 of expert 1.
    fault(
        "q4_k_m",
        "nan-scale",
        "blk.2.ffn_up_exps.weight",
        &["300", "0"],
        "nan_origin",
        "nan_inf",
    ),
    fault(
        "q4_k_m",
        "copy-rows",
        "blk.2.attn_output.weight",
        &["blk.1.attn_output.weight", "0", "16"],
        "corrupt_weight",
        "other_tensor",
    ),
    fault(
        "q4_k_m",
        "zero",
        "blk.1.exp_probs_b.bias",
        &[],
        "router_mismatch",
        "zeros",
    ),
    fault(
        "q4_k_m",
        "zero",
        "output.weight",
        &[],
        "flat_logits",
        "zeros",
    ),
    // The only blocks of rows 5 and 6.
    fault(
        "q4_k_m",
        "garbage",
        "blk.0.attn_kv_a_mqa.weight",
        &["5", "0", "2", "7"],
        "corrupt_weight",
        "garbage_blocks",
    ),
    fault(
        "q4_k_m-imatrix",
        "scale",
        "blk.1.attn_output.weight",
        &["2"],
        "scale_mismatch",
        "scalar_multiple",
    ),
    // 5% hides inside 4-bit noise segment by segment; the whole tensor's factor shows it.
    fault(
        "q4_k_m-imatrix",
        "scale",
        "blk.1.attn_q_b.weight",
        &["1.05"],
        "scale_mismatch",
        "scalar_multiple",
    ),
    fault(
        "q4_k_m-imatrix",
        "swap-experts",
        "blk.2.ffn_gate_exps.weight",
        &["0", "7"],
        "weight_layout",
        "expert_permutation",
    ),
    // Block 2 of row 3 (8 blocks a row).
    fault(
        "q8_0",
        "garbage",
        "blk.0.attn_q_a.weight",
        &["3", "2", "1", "11"],
        "corrupt_weight",
        "garbage_blocks",
    ),
    // In a later file of the split set llama-gguf-split made.
    fault(
        "q4_k_m-split",
        "swap-experts",
        "blk.2.ffn_down_exps.weight",
        &["1", "5"],
        "weight_layout",
        "expert_permutation",
    ),
    fault(
        "iq4_xs",
        "swap-experts",
        "blk.1.ffn_up_exps.weight",
        &["2", "3"],
        "weight_layout",
        "expert_permutation",
    ),
    fault(
        "f32",
        "swap-experts",
        "blk.1.ffn_gate_exps.weight",
        &["2", "6"],
        "weight_layout",
        "expert_permutation",
    ),
    fault(
        "f32",
        "scale",
        "blk.1.attn_output.weight",
        &["2"],
        "scale_mismatch",
        "scalar_multiple",
    ),
    fault(
        "f32",
        "zero",
        "blk.2.exp_probs_b.bias",
        &[],
        "router_mismatch",
        "zeros",
    ),
    // [4 heads, 256, 64]: each head's values written in 64 x 256 order.
    Fault {
        gguf_reference: true,
        ..fault(
            "f32",
            "untranspose-heads",
            "blk.0.attn_k_b.weight",
            &[],
            "weight_layout",
            "transpose",
        )
    },
];

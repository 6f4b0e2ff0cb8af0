//! SGLang's module names (its `DeepseekV2ForCausalLM` tree, which GLM-5's `GlmMoeDsaForCausalLM`
//! and the DeepSeek classes share) mapped to glmcheck's stages: which hook output is which
//! stage, and how the tensor-parallel ranks' copies of it relate.

/// How the ranks' tensors of one hook relate to the whole stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds the whole stage; ranks that differ are listed as disagreeing.
    Replicated,
    /// Each rank holds its attention heads (`t h(tp) d`).
    Heads,
    /// Reduced inside the module (ranks equal) or left to a later all-reduce (ranks hold
    /// partial sums, `t d partial(tp)`), as SGLang's settings decide.
    MaybePartial,
}

/// Where a hook's tensor goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A stage of the hook's own layer (`attn.q`, `ffn_norm`…), or a stage outside the layers.
    Stage(&'static str, Split),
    /// `fused_qkv_a_proj_with_mqa`: `attn.q_a` and `attn.kv_a` side by side.
    FusedQkvA,
    /// The residual stream a fused add-and-norm returns: the previous layer's `out` (at the
    /// final norm, the last layer's).
    PreviousOut,
}

/// Per layer: (module under `model.layers.N.`, what of it, target).
const LAYER_HOOKS: &[(&str, &str, Target)] = {
    use Split::*;
    use Target::*;
    &[
        ("input_layernorm", "output", Stage("attn_norm", Replicated)),
        (
            "input_layernorm",
            "output.0",
            Stage("attn_norm", Replicated),
        ),
        ("input_layernorm", "output.1", PreviousOut),
        ("self_attn.fused_qkv_a_proj_with_mqa", "output", FusedQkvA),
        (
            "self_attn.q_a_proj",
            "output",
            Stage("attn.q_a", Replicated),
        ),
        (
            "self_attn.kv_a_proj_with_mqa",
            "output",
            Stage("attn.kv_a", Replicated),
        ),
        (
            "self_attn.q_a_layernorm",
            "output",
            Stage("attn.q_a_norm", Replicated),
        ),
        ("self_attn.q_b_proj", "output", Stage("attn.q", Heads)),
        // DeepSeek-V2-Lite has no q LoRA: `q_proj` makes the query from the hidden state.
        ("self_attn.q_proj", "output", Stage("attn.q", Heads)),
        (
            "self_attn.kv_a_layernorm",
            "output",
            Stage("attn.kv_a_norm", Replicated),
        ),
        ("self_attn.kv_b_proj", "output", Stage("attn.kv", Heads)),
        (
            "self_attn.rotary_emb",
            "output.0",
            Stage("attn.q_rope", Heads),
        ),
        (
            "self_attn.rotary_emb",
            "output.1",
            Stage("attn.k_rope", Replicated),
        ),
        (
            "self_attn.indexer",
            "output",
            Stage("attn.index_topk", Replicated),
        ),
        ("self_attn.o_proj", "inputs.0", Stage("attn.ctx", Heads)),
        (
            "self_attn.o_proj",
            "output",
            Stage("attn.out", MaybePartial),
        ),
        (
            "post_attention_layernorm",
            "output.0",
            Stage("ffn_norm", Replicated),
        ),
        (
            "post_attention_layernorm",
            "output.1",
            Stage("attn_resid", Replicated),
        ),
        ("mlp.gate", "output", Stage("moe.router_logits", Replicated)),
        (
            "mlp.topk",
            "output.0",
            Stage("moe.topk_weights", Replicated),
        ),
        ("mlp.topk", "output.1", Stage("moe.topk_ids", Replicated)),
        ("mlp.experts", "output", Stage("moe.routed", MaybePartial)),
        (
            "mlp.shared_experts",
            "output",
            Stage("moe.shared", MaybePartial),
        ),
        ("mlp", "output", Stage("ffn.out", MaybePartial)),
    ]
};

/// Outside the layers: (module, what of it, target).
const MODEL_HOOKS: &[(&str, &str, Target)] = {
    use Split::*;
    use Target::*;
    &[
        ("model.embed_tokens", "output", Stage("embed", Replicated)),
        ("model.norm", "output", Stage("final_norm", Replicated)),
        ("model.norm", "output.0", Stage("final_norm", Replicated)),
        ("model.norm", "output.1", PreviousOut),
        // The logits processor's output object: the prompt's last row only.
        (
            "logits_processor",
            "output.next_token_logits",
            Stage("logits", Replicated),
        ),
    ]
};

/// The prefix SGLang's dumper gives every hook name in its `all` mode.
pub const HOOK_PREFIX: &str = "non_intrusive__";

/// A hook name split: its module, the layer the module sits in, and what of it was dumped.
#[derive(Debug, PartialEq, Eq)]
pub struct Hook<'a> {
    /// `model.layers.N.` left out for a layer's module.
    pub module: &'a str,
    pub layer: Option<u64>,
    /// `output`, `output.1`, `inputs.0`, `output.next_token_logits`…
    pub what: &'a str,
}

impl<'a> Hook<'a> {
    /// Parse `non_intrusive__model.layers.3.self_attn.o_proj.output`; None for other names.
    pub fn parse(name: &'a str) -> Option<Hook<'a>> {
        let rest = name.strip_prefix(HOOK_PREFIX)?;
        let at = [".output", ".inputs."]
            .iter()
            .filter_map(|m| rest.rfind(m))
            .max()?;
        let (module, what) = (&rest[..at], &rest[at + 1..]);
        let in_layer = module.strip_prefix("model.layers.").and_then(|r| {
            let (n, sub) = r.split_once('.')?;
            Some((n.parse().ok()?, sub))
        });
        Some(match in_layer {
            Some((layer, sub)) => Hook {
                module: sub,
                layer: Some(layer),
                what,
            },
            None => Hook {
                module,
                layer: None,
                what,
            },
        })
    }

    /// Where this hook's tensor goes, or None for a hook glmcheck has no stage for.
    pub fn target(&self) -> Option<Target> {
        let table = match self.layer {
            Some(_) => LAYER_HOOKS,
            None => MODEL_HOOKS,
        };
        table
            .iter()
            .find(|(m, w, _)| *m == self.module && *w == self.what)
            .map(|(_, _, t)| t.clone())
    }
}

/// A `DUMPER_FILTER` expression (Python, over the dumper's tags) that keeps the files glmcheck
/// reads and drops the rest: a third of the files of an unfiltered dump.
pub fn dumper_filter() -> String {
    let escape = |s: &str| s.replace('.', r"\.");
    let (mut layer, mut model): (Vec<String>, Vec<String>) = (Vec::new(), Vec::new());
    for (in_layer, module, what, _) in known_hooks() {
        let list = if in_layer { &mut layer } else { &mut model };
        list.push(format!("{}\\.{}", escape(module), escape(what)));
    }
    format!(
        "name in ('input_ids', 'seq_lens') or match(r'{HOOK_PREFIX}(model\\.layers\\.\\d+\\.({})|{})$', \
         name) is not None",
        layer.join("|"),
        model.join("|")
    )
}

/// Every (module, what) the map reads, for the documentation's table and its test.
pub fn known_hooks() -> impl Iterator<Item = (bool, &'static str, &'static str, &'static Target)> {
    let layer = LAYER_HOOKS.iter().map(|(m, w, t)| (true, *m, *w, t));
    let model = MODEL_HOOKS.iter().map(|(m, w, t)| (false, *m, *w, t));
    layer.chain(model)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hook_names_split_into_module_layer_and_output() {
        let h = Hook::parse("non_intrusive__model.layers.12.self_attn.o_proj.inputs.0").unwrap();
        assert_eq!(
            (h.module, h.layer, h.what),
            ("self_attn.o_proj", Some(12), "inputs.0")
        );
        assert_eq!(h.target(), Some(Target::Stage("attn.ctx", Split::Heads)));
        let h = Hook::parse("non_intrusive__logits_processor.output.next_token_logits").unwrap();
        assert_eq!((h.module, h.layer), ("logits_processor", None));
        assert_eq!(h.target(), Some(Target::Stage("logits", Split::Replicated)));
        let h = Hook::parse("non_intrusive__model.layers.1.input_layernorm.output.1").unwrap();
        assert_eq!(h.target(), Some(Target::PreviousOut));
        assert_eq!(Hook::parse("input_ids"), None);
        let act = Hook::parse("non_intrusive__model.layers.0.mlp.act_fn.output").unwrap();
        assert_eq!(act.target(), None);
    }

    #[test]
    fn the_guide_gives_this_filter_and_every_hook_read() {
        let guide = include_str!("../../../probes/sglang/README.md");
        let filter = dumper_filter();
        assert!(guide.contains(&filter), "the filter:\n{filter}");
        for (_, module, what, _) in known_hooks() {
            let (m, w) = (format!("`{module}`"), format!("`{what}`"));
            let listed = guide.lines().any(|l| l.contains(&m) && l.contains(&w));
            assert!(listed, "{module} {what} is not in the guide's table");
        }
    }
}

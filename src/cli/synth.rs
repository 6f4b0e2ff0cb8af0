//! `glmcheck synth`: write a synthetic model of the MLA/MoE family (GLM-5 by default) as GGUF
//! or a Hugging Face folder.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;

use super::{one_of, Outcome};
use crate::model::schema::ExpertForm;
use crate::report::synth::{text, SynthReport};
use crate::synth::mix::{parse_override, Mix};
use crate::synth::weights::check_massive;
use crate::synth::{preset::apply_overrides, Massive, Preset, SynthFamily, SynthSpec};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// llama.cpp's GGUF (`glm-dsa`; `deepseek2` or `deepseek32` for the other members): split
    /// attn_k_b/attn_v_b, stacked experts, MTP layer.
    Gguf,
    /// A Hugging Face folder: config.json for the member's transformers class, safetensors,
    /// tokenizer.
    Hf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum HfExperts {
    /// One tensor per expert and projection, as the published checkpoints store them.
    PerExpert,
    /// transformers' packed `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`.
    Fused,
}

#[derive(clap::Args, Debug)]
pub struct SynthArgs {
    /// Starting size: `tiny` (CI speed: one dense and two MoE layers, hidden 256), `small` (a
    /// few hundred MB: benchmarks) or `glm5-dims` (GLM-5's real widths, sized with `--layers`
    /// and `--experts`).
    #[arg(long, default_value = "tiny", value_parser = one_of(&Preset::ALL, Preset::name))]
    pub preset: Preset,
    /// Member of the MLA/MoE family, at the preset's widths with the member's own switches:
    /// `glm5`, `glm-4.7-flash`, `deepseek-v2` (softmax, group-limited, no bias),
    /// `deepseek-v2-lite` (no q LoRA), `deepseek-v3` (grouped noaux_tc, YaRN), `deepseek-v3.2`
    /// (V3 with the DSA indexer rotating NeoX halves), `kimi-k2` (one group, YaRN ×32). GGUF
    /// output uses llama.cpp's architecture for it (`deepseek2`, `deepseek32`).
    #[arg(long, default_value = "glm5", value_parser = one_of(&SynthFamily::ALL, SynthFamily::name))]
    pub family: SynthFamily,
    /// Number of forward layers (the MTP layer comes on top).
    #[arg(long)]
    pub layers: Option<u64>,
    /// Number of routed experts.
    #[arg(long)]
    pub experts: Option<u64>,
    /// Override any config field, e.g. `--set n_group=8 --set rope_theta=8e6`; GLM-5.2's shared
    /// indexer layers: `--set index_topk_freq=4 --set index_skip_topk_offset=3`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Seed of the weights: the same seed and options give byte-identical files.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Storage mix (`f32`, `bf16`, `q8_0`, `q4_k_m`, `ud-iq`; `fp8`: GLM-5-FP8's Hugging Face
    /// layout, 128×128 block scales; `fp8-ue8m0`: DeepSeek-V3.1's, those scales rounded up to
    /// powers of two, `scale_fmt: "ue8m0"`), and `GLOB=TYPE` overrides (repeatable, first match
    /// wins), e.g. `--quant q4_k_m --quant '*attn_k_b*=Q8_0'`.
    #[arg(long = "quant", value_name = "MIX|GLOB=TYPE")]
    pub quant: Vec<String>,
    #[arg(long, value_enum, default_value = "gguf")]
    pub format: Format,
    /// Expert layout of the Hugging Face form.
    #[arg(long, value_enum, default_value = "per-expert")]
    pub hf_experts: HfExperts,
    /// Write valid random blocks instead of quantizing generated weights: disk speed, for
    /// size and speed tests (the model then means nothing).
    #[arg(long)]
    pub fast: bool,
    /// Drive the residual stream past fp16's range at this layer (`L` or `L=VALUE`,
    /// 65504 < VALUE ≤ 118000, default 110000): layer L's attention and FFN each add about half
    /// of it, so no op leaves fp16 and only an fp16 run without vLLM's residual rescaling
    /// overflows; in f32 the model predicts as before.
    #[arg(long, value_name = "LAYER[=VALUE]")]
    pub fp16_overflow: Option<String>,
    /// Output: a `.gguf` file, or a folder for `--format hf`.
    #[arg(long)]
    pub out: PathBuf,
    /// Print what was written as JSON.
    #[arg(long)]
    pub json: bool,
}

fn parse_massive(s: &str) -> anyhow::Result<Massive> {
    let (layer, value) = s.split_once('=').unwrap_or((s, ""));
    let layer = layer
        .parse()
        .with_context(|| format!("--fp16-overflow `{s}`: layer"))?;
    let value = if value.is_empty() {
        Massive::DEFAULT_VALUE
    } else {
        value
            .parse()
            .with_context(|| format!("--fp16-overflow `{s}`: value"))?
    };
    Ok(Massive { layer, value })
}

/// The spec the arguments describe.
pub fn spec(args: &SynthArgs) -> anyhow::Result<SynthSpec> {
    let mut sets = args.sets.clone();
    if let Some(l) = args.layers {
        sets.insert(0, format!("num_hidden_layers={l}"));
    }
    if let Some(e) = args.experts {
        sets.insert(0, format!("n_routed_experts={e}"));
    }
    let base = args.family.apply(args.preset.config());
    let cfg = apply_overrides(&base, &sets).context("--set")?;
    let mut spec = SynthSpec::new(cfg, args.seed);
    for q in &args.quant {
        if q.contains('=') {
            spec.overrides.push(parse_override(q)?);
        } else {
            spec.mix = q
                .parse::<Mix>()
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("--quant `{q}`"))?;
        }
    }
    spec.fast = args.fast;
    if let Some(m) = &args.fp16_overflow {
        let m = parse_massive(m)?;
        check_massive(&spec.cfg, &m).map_err(anyhow::Error::msg)?;
        spec.massive = Some(m);
    }
    Ok(spec)
}

pub fn run(args: SynthArgs) -> anyhow::Result<Outcome> {
    let spec = spec(&args)?;
    let start = Instant::now();
    let written = match args.format {
        Format::Gguf => spec.write_gguf(&args.out),
        Format::Hf => {
            let experts = if args.hf_experts == HfExperts::Fused {
                ExpertForm::FusedGateUp
            } else {
                ExpertForm::PerExpert
            };
            spec.write_hf(&args.out, experts)
        }
    }
    .with_context(|| args.out.display().to_string())?;
    let report = SynthReport {
        config: spec.cfg,
        seconds: start.elapsed().as_secs_f64(),
        written,
        out: args.out,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", text(&report));
    }
    Ok(Outcome::Pass)
}

//! `glmcheck demo`: the embedded default. It builds a tiny Q4_K_M GLM-5 GGUF in a temporary
//! folder, shows `inspect` and `dequant` on it, runs the CPU reference on a prompt and a bf16
//! candidate, and compares them with `diff` and `logits`. (The TP candidate with an injected
//! fault and `bisect` join it as they land.)

use super::dequant::{self, DequantArgs};
use super::diff::{self, DiffArgs};
use super::inspect::{self, InspectArgs};
use super::logits::{self, LogitsArgs};
use super::run::{self, RunArgs};
use super::{ModelArg, Outcome};
use crate::exec::backend::Precision;
use crate::exec::forward::HF_LATENT_NORM_EPS;
use crate::synth::{Mix, Preset, SynthSpec};

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Seed of the synthetic model's weights.
    #[arg(long, default_value_t = 5)]
    pub seed: u64,
    /// Machine-readable JSON on stdout (the inspect and dequant reports, one per line).
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: DemoArgs) -> anyhow::Result<Outcome> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("glm5-tiny.gguf");
    let mut spec = SynthSpec::new(Preset::Tiny.config(), args.seed);
    spec.mix = Mix::Q4KM;
    spec.write_gguf(&path)?;
    let cfg = &spec.cfg;
    let say = |s: &str| {
        if !args.json {
            println!("\n== {s}\n");
        }
    };
    say(&format!(
        "built a tiny GLM-5 ({} layers + MTP, {} experts) at {}",
        cfg.num_hidden_layers,
        cfg.n_routed_experts,
        path.display()
    ));
    say("glmcheck inspect glm5-tiny.gguf");
    let model = || ModelArg {
        model: path.clone(),
        json: args.json,
    };
    let inspected = inspect::run(InspectArgs {
        model: model(),
        all: false,
    })?;
    say("glmcheck dequant glm5-tiny.gguf --tensor 'blk.1.*'");
    let checked = dequant::run(DequantArgs {
        model: model(),
        tensors: vec!["blk.1.*".into()],
        dump: None,
    })?;
    say("glmcheck run glm5-tiny.gguf --prompt 'The capital of France is' --generate 8 --out reference.trace");
    let run_at = |dtype: Precision, name: &str| {
        run::run(RunArgs {
            model: path.clone(),
            tokens: Vec::new(),
            prompt: Some("The capital of France is".into()),
            out: dir.path().join(name),
            full: Vec::new(),
            latent_norm_eps: HF_LATENT_NORM_EPS,
            generate: 8,
            tp: 1,
            inject: None,
            dtype,
            json: args.json,
        })
    };
    let ran = run_at(Precision::F32, "reference.trace")?;
    say("glmcheck run glm5-tiny.gguf --prompt ... --dtype bf16 --out candidate.trace");
    let candidate = run_at(Precision::Bf16, "candidate.trace")?;
    say("glmcheck diff reference.trace candidate.trace");
    let diffed = diff::run(DiffArgs {
        reference: dir.path().join("reference.trace"),
        candidate: dir.path().join("candidate.trace"),
        envelope: None,
        tolerance: None,
        json: args.json,
        markdown: false,
        html: None,
    })?;
    say("glmcheck logits candidate.trace --reference reference.trace");
    let logits = logits::run(LogitsArgs {
        trace: dir.path().join("candidate.trace"),
        reference: Some(dir.path().join("reference.trace")),
        json: args.json,
    })?;
    Ok(
        if [inspected, checked, ran, candidate, diffed, logits]
            .iter()
            .all(|o| *o == Outcome::Pass)
        {
            Outcome::Pass
        } else {
            Outcome::Fail
        },
    )
}

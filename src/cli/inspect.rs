//! `glmcheck inspect MODEL`: what a checkpoint holds, which member of the family it is, and
//! whether it is complete.

use super::{ModelArg, Outcome};
use crate::pipeline::inspect::inspect;
use crate::progress::progress;
use crate::report::inspect::text;
use crate::weights::ModelFiles;

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// List every tensor and metadata key (by default long listings are cut).
    #[arg(long)]
    pub all: bool,
}

pub fn run(args: InspectArgs) -> anyhow::Result<Outcome> {
    let spinner = progress(1, args.model.json, "reading headers");
    let files = ModelFiles::open(&args.model.model)?;
    spinner.finish_and_clear();
    let report = inspect(&files)?;
    if args.model.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", text(&report, args.all));
    }
    Ok(match report.schema {
        Some(s) if !s.ok => Outcome::Fail,
        _ => Outcome::Pass,
    })
}

//! `glmcheck run`'s report: the trace written, the top-1 token per position, what was generated,
//! and with `--profile` where the recorded pass spent its time; as JSON or terminal text.

use std::fmt::Write;
use std::path::PathBuf;

use comfy_table::Table;
use serde::Serialize;

use super::terminal::table;
use crate::exec::ops::op_clock::OpTime;

/// One recorded run.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    pub generated: Vec<u32>,
    /// `--profile`: the recorded pass's time by op.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<Profile>,
    /// The generated tokens decoded, where the model has a tokenizer.
    pub text: Option<String>,
    pub tokens: Vec<u32>,
    pub top1: Vec<usize>,
    pub trace: PathBuf,
    /// The prompt text given, printed before the generated text.
    #[serde(skip)]
    pub prompt: Option<String>,
}

/// Where the recorded pass spent its time.
#[derive(Clone, Debug, Serialize)]
pub struct Profile {
    /// The backend's ops and the stages' recording, the costliest first (thread-seconds).
    pub ops: Vec<OpShare>,
    /// The recorded pass's wall time.
    pub pass_seconds: f64,
}

/// One op's calls and time.
#[derive(Clone, Debug, Serialize)]
pub struct OpShare {
    pub calls: u64,
    pub op: &'static str,
    pub seconds: f64,
}

impl Profile {
    pub fn new(op_times: &[OpTime], pass_seconds: f64) -> Profile {
        Profile {
            ops: op_times
                .iter()
                .map(|t| OpShare {
                    calls: t.calls,
                    op: t.op.name(),
                    seconds: t.seconds,
                })
                .collect(),
            pass_seconds,
        }
    }

    /// The time by op; what the ops leave of the pass's wall time is the host's own work between
    /// them (routing, top-k, copies, waits).
    fn table(&self) -> Table {
        let pass_seconds = self.pass_seconds;
        let mut t = table(&["op", "calls", "seconds", "share of the pass"]);
        let share = |s: f64| format!("{:.1}%", 100.0 * s / pass_seconds.max(f64::MIN_POSITIVE));
        for o in &self.ops {
            t.add_row(vec![
                o.op.to_string(),
                o.calls.to_string(),
                format!("{:.4}", o.seconds),
                share(o.seconds),
            ]);
        }
        let in_ops: f64 = self.ops.iter().map(|o| o.seconds).sum();
        // Ops run from several threads at once (ranks, experts) can add up past the wall time.
        let between = if in_ops <= pass_seconds {
            (
                format!("{:.4}", pass_seconds - in_ops),
                share(pass_seconds - in_ops),
            )
        } else {
            ("—".to_string(), "ops overlap in threads".to_string())
        };
        t.add_row(vec![
            "between the ops".to_string(),
            String::new(),
            between.0,
            between.1,
        ]);
        t.add_row(vec![
            "the pass (wall)".to_string(),
            String::new(),
            format!("{pass_seconds:.4}"),
            "100%".to_string(),
        ]);
        t
    }
}

impl RunReport {
    /// The trace written, the top-1 tokens, the generated tokens and text, the profile.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "wrote {} ({} positions); top-1 per position: {:?}",
            self.trace.display(),
            self.top1.len(),
            self.top1
        );
        if !self.generated.is_empty() {
            let _ = writeln!(out, "generated: {:?}", self.generated);
        }
        if let (Some(prompt), Some(text)) = (&self.prompt, &self.text) {
            let _ = writeln!(out, "{prompt}{text}");
        }
        if let Some(p) = &self.profile {
            let _ = writeln!(out, "{}", p.table());
        }
        out
    }
}

//! Another DSA key choice, told apart: the reference's own indexer inputs scored again with the
//! rotary embedding engines have got wrong — the other pair order (the bug DeepSeek-V3.2's
//! indexer met in several engines, which rotated adjacent pairs where the model turns NeoX
//! halves) and the rope dims taken from the end of each head instead of its start. A rotation
//! that gives the candidate's choice at every position names what the candidate's indexer does;
//! the ids it is held to are kept whole by every probe's default recording.

use anyhow::Result;

use super::choice::{divergent_fault, named_together, Choices, Fit};
use crate::compare::stage_diff::whole_values;
use crate::compare::{DiffReport, FaultClass};
use crate::exec::attention::{indexer_choices, IndexerRotation};
use crate::exec::mat::Mat;
use crate::exec::ops::ties::TieBreaks;
use crate::exec::source::WeightSource;
use crate::model::{Glm5Config, Stage};
use crate::trace::Trace;

/// The configured rotation first, then the wrong ones, each with what it changes in words.
fn rotations(cfg: &Glm5Config) -> [(IndexerRotation, String); 3] {
    let interleaved = cfg.indexer_rope_interleave;
    let order = |interleaved: bool| match interleaved {
        true => "adjacent pairs",
        false => "NeoX halves",
    };
    let own = IndexerRotation {
        interleaved,
        rope_trailing: false,
    };
    [
        (own, "the configured rotation".into()),
        (
            IndexerRotation {
                interleaved: !interleaved,
                ..own
            },
            format!(
                "its query and key rotated in {} where the model turns {}",
                order(!interleaved),
                order(interleaved)
            ),
        ),
        (
            IndexerRotation {
                rope_trailing: true,
                ..own
            },
            "its rotary embedding on each head's last rope dims where the model turns its first"
                .into(),
        ),
    ]
}

/// Add to an `indexer_mismatch` at `L{n}.attn.index_topk` the rotation that gives the
/// candidate's choices, where one does: in the summary when the traces alone classed the fault
/// (`rename`), else as evidence beside the cause a setting already names.
pub fn explain_choice(
    src: &WeightSource,
    (reference, candidate): (&Trace, &Trace),
    report: &mut DiffReport,
    (rename, ties): (bool, Option<&TieBreaks>),
) -> Result<()> {
    // Where a lower precision left the top-k unjudged for near ties, the divergence is first
    // seen at the attention it feeds.
    let kinds = ["attn.index_topk", "attn.ctx"];
    let Some((l, fault)) = divergent_fault(report, &kinds, FaultClass::IndexerMismatch) else {
        return Ok(());
    };
    let stage = |kind| Stage::layer_stage(l, kind).to_string();
    let ids_stage = stage("attn.index_topk");
    let (Some((hn, hn_shape)), Some((q_a, q_a_shape)), Some((ours, _)), Some((theirs, shape))) = (
        whole_values(reference, &stage("attn_norm"))?,
        whole_values(reference, &stage("attn.q_a_norm"))?,
        whole_values(reference, &ids_stage)?,
        whole_values(candidate, &ids_stage)?,
    ) else {
        return Ok(());
    };
    let (Ok(hn), Ok(q_a)) = (
        Mat::from_shape(hn, &hn_shape),
        Mat::from_shape(q_a, &q_a_shape),
    ) else {
        return Ok(());
    };
    let t = hn.rows;
    let k = (src.cfg.index_topk as usize).min(t);
    if q_a.rows != t || shape != [t as u64, k as u64] || ours.len() != t * k || t == 0 {
        return Ok(());
    }
    let reference_tie = |p: usize| ties.is_some_and(|t| t.dsa_at(l, p).is_some());
    let near: Option<&dyn Fn(usize) -> bool> = ties.map(|_| &reference_tie as _);
    let all = rotations(&src.cfg);
    let choose = |rotation| -> Result<Choices> {
        let (chosen, gaps) = indexer_choices(src, l, (&hn, &q_a), rotation)?;
        let ids = chosen
            .into_iter()
            .map(|row| row.into_iter().map(i64::from).collect())
            .collect();
        Ok(Choices { ids, gaps })
    };
    // The configured rotation must give the reference's own choices, else the inputs are not
    // read as the indexer reads them.
    let own = choose(all[0].0)?;
    if !own.fit(&ours, k, near).holds(t) {
        return Ok(());
    }
    // A hypothesis counts where the configured choice cannot hold the candidate's, even at near
    // ties.
    let configured = own.fit(&theirs, k, near);
    if configured.holds(t) {
        return Ok(());
    }
    let mut fitting: Vec<(&str, Fit)> = Vec::new();
    for (rotation, what) in &all[1..] {
        let fit = choose(*rotation)?.fit(&theirs, k, near);
        if fit.holds(t) {
            fitting.push((what, fit));
        }
    }
    let names: Vec<&str> = fitting.iter().map(|(what, _)| *what).collect();
    let Some(what) = named_together(&names) else {
        return Ok(());
    };
    if rename {
        fault.summary = format!("{ids_stage}: the DSA indexer chooses as with {what}");
    }
    fault.evidence.push(format!(
        "the reference's indexer inputs at layer {l} (attn_norm, attn.q_a_norm), scored again \
         with {what}, give the candidate's choices at {} (the configured rotation's at \
         {})",
        fitting[0].1.positions(t),
        configured.same
    ));
    Ok(())
}

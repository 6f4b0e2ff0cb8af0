//! Another DSA key choice, told apart: the reference's own indexer inputs scored again with the
//! rotary embedding engines have got wrong — the other pair order (the bug DeepSeek-V3.2's
//! indexer met in several engines, which rotated adjacent pairs where the model turns NeoX
//! halves) and the rope dims taken from the end of each head instead of its start. A rotation
//! that gives the candidate's choice at every position names what the candidate's indexer does;
//! the ids it is held to are kept whole by every probe's default recording.

use anyhow::Result;

use crate::compare::stage_diff::whole_values;
use crate::compare::{DiffReport, FaultClass};
use crate::exec::attention::{indexer_choices, IndexerRotation};
use crate::exec::mat::Mat;
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
    rename: bool,
) -> Result<()> {
    let kinds = ["attn.index_topk"];
    let Some((l, fault)) = super::divergent_fault(report, &kinds, FaultClass::IndexerMismatch)
    else {
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
    let set = |ids: &[f32]| {
        let mut s: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
        s.sort_unstable();
        s
    };
    let matching = |chosen: &[Vec<i32>], target: &[f32]| {
        (0..t)
            .filter(|&p| {
                let ids: Vec<f32> = chosen[p].iter().map(|&i| i as f32).collect();
                set(&ids) == set(&target[p * k..(p + 1) * k])
            })
            .count()
    };
    let all = rotations(&src.cfg);
    let chosen = |rotation| indexer_choices(src, l, (&hn, &q_a), rotation);
    // The configured rotation must give the reference's own choices, else the inputs are not
    // read as the indexer reads them.
    let configured = chosen(all[0].0)?;
    if matching(&configured, &ours) != t {
        return Ok(());
    }
    let mut fits = Vec::new();
    for (rotation, what) in &all[1..] {
        if matching(&chosen(*rotation)?, &theirs) == t {
            fits.push(what.as_str());
        }
    }
    let Some(what) = super::named_together(&fits) else {
        return Ok(());
    };
    if rename {
        fault.summary = format!("{ids_stage}: the DSA indexer chooses as with {what}");
    }
    fault.evidence.push(format!(
        "the reference's indexer inputs at layer {l} (attn_norm, attn.q_a_norm), scored again \
         with {what}, give the candidate's choices at all {t} positions (the configured \
         rotation's at {})",
        matching(&configured, &theirs)
    ));
    Ok(())
}

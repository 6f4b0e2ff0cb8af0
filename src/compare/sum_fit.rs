//! A sum whose inputs agree but which weighs them otherwise: the candidate's sum fitted by least
//! squares as `Σ wᵢ·inputᵢ` on the reference's inputs. A good fit away from 1 : 1 is an operand
//! scaled and the others not: an fp16 guard that divides the residual stream by
//! `routed_scaling_factor` on one side only, or the routed experts' factor applied twice.

use anyhow::Result;

use super::fault::{Fault, FaultClass};
use super::stage_diff::{input, whole_values, StageDiff, Status};
use crate::model::Stage;
use crate::trace::Trace;

/// A relative misfit above this is no weighted sum of the inputs (or above the stage's own
/// noise: a `rel_diff` tolerance τ allows a relative error of √(2τ), at bf16 some 3e-2).
const MISFIT: f64 = 1e-2;
/// Weights within this of 1 are the plain sum.
const BALANCED: f64 = 1e-2;

/// The stages `stage` sums, as the candidate shows them: the attention output and the stream for
/// `attn_resid`; the FFN output and `attn_resid` for `out` (the routed and shared experts in its
/// place where the candidate does not hold it, as SGLang's older dump hook shows a MoE layer);
/// the routed and shared experts for a MoE layer's `ffn.out`.
fn terms(reference: &Trace, candidate: &Trace, stage: &Stage) -> Option<Vec<String>> {
    let l = stage.layer()?;
    let at = |k: &str| Stage::layer_stage(l, k).to_string();
    let moe = [at("moe.routed"), at("moe.shared")];
    let has_moe = moe.iter().all(|n| reference.stage(n, None).is_some());
    let held = |n: &str| candidate.stages().iter().any(|s| s.name == n);
    let names = match stage.kind() {
        "attn_resid" => vec![at("attn.out"), Stage::layer_input(l).to_string()],
        "out" if has_moe && !held(&at("ffn.out")) => {
            [moe.to_vec(), vec![at("attn_resid")]].concat()
        }
        "out" => vec![at("ffn.out"), at("attn_resid")],
        "ffn.out" if has_moe => moe.to_vec(),
        _ => return None,
    };
    names
        .iter()
        .all(|n| reference.stage(n, None).is_some())
        .then_some(names)
}

/// Least squares `y ≈ Σ wᵢ·xᵢ`: the weights and the relative misfit, or None where the inputs
/// are (nearly) dependent.
fn fit(xs: &[Vec<f32>], y: &[f32]) -> Option<(Vec<f64>, f64)> {
    let n = xs.len();
    let dot = |p: &[f32], q: &[f32]| -> f64 {
        p.iter()
            .zip(q)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum()
    };
    // The normal equations [XᵀX | Xᵀy], solved by elimination with partial pivoting.
    let mut m: Vec<Vec<f64>> = (0..n)
        .map(|i| {
            let mut row: Vec<f64> = (0..n).map(|j| dot(&xs[i], &xs[j])).collect();
            row.push(dot(&xs[i], y));
            row
        })
        .collect();
    let scale = (0..n).map(|i| m[i][i]).fold(0.0, f64::max);
    for c in 0..n {
        let p = (c..n).max_by(|&a, &b| m[a][c].abs().total_cmp(&m[b][c].abs()))?;
        if m[p][c].abs() <= 1e-9 * scale {
            return None;
        }
        m.swap(c, p);
        for r in 0..n {
            if r != c {
                let f = m[r][c] / m[c][c];
                let pivot = m[c].clone();
                m[r].iter_mut().zip(&pivot).for_each(|(v, q)| *v -= f * q);
            }
        }
    }
    let w: Vec<f64> = (0..n).map(|i| m[i][n] / m[i][i]).collect();
    let yy = dot(y, y);
    if yy == 0.0 {
        return None;
    }
    let misfit: f64 = (0..y.len())
        .map(|k| {
            let fitted: f64 = xs.iter().zip(&w).map(|(x, wi)| wi * f64::from(x[k])).sum();
            (f64::from(y[k]) - fitted).powi(2)
        })
        .sum();
    Some((w, (misfit / yy).sqrt()))
}

/// `stages[i]`, a sum whose inputs agree, weighing them otherwise: `scale_mismatch` with the
/// weights.
pub fn sum_fault(
    reference: &Trace,
    candidate: &Trace,
    stages: &[StageDiff],
    i: usize,
) -> Result<Option<Fault>> {
    let s = &stages[i];
    let Some(names) = Stage::parse(&s.stage).and_then(|st| terms(reference, candidate, &st)) else {
        return Ok(None);
    };
    if names
        .iter()
        .any(|n| input(stages, i, n).is_some_and(|p| p.status != Status::Pass))
    {
        return Ok(None);
    }
    let Some((y, _)) = whole_values(candidate, &s.stage)? else {
        return Ok(None);
    };
    let mut xs = Vec::new();
    for n in &names {
        match whole_values(reference, n)? {
            Some((x, _)) if x.len() == y.len() => xs.push(x),
            _ => return Ok(None),
        }
    }
    let Some((w, misfit)) = fit(&xs, &y) else {
        return Ok(None);
    };
    let noise = (2.0 * s.tolerance).sqrt();
    if misfit > MISFIT.max(noise) || w.iter().all(|wi| (wi - 1.0).abs() < BALANCED) {
        return Ok(None);
    }
    let weights: Vec<String> = w.iter().map(|wi| format!("{wi:.4}")).collect();
    let ones = vec!["1"; w.len()].join(" : ");
    let terms: Vec<String> = w
        .iter()
        .zip(&names)
        .map(|(wi, n)| format!("{wi:.4}·{n}"))
        .collect();
    let (lo, hi) = w
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    Ok(Some(Fault {
        class: FaultClass::ScaleMismatch,
        summary: format!(
            "{}: the sum of {} and {} weighs them {}, not {ones}",
            s.stage,
            names[..names.len() - 1].join(", "),
            names[names.len() - 1],
            weights.join(" : ")
        ),
        evidence: vec![
            format!(
                "{} = {} (fitted on the reference's inputs, which the candidate's agree with; \
                 relative misfit {misfit:.1e})",
                s.stage,
                terms.join(" + ")
            ),
            format!(
                "one operand is {:.4}× another: a scale applied to one side only (a \
                 routed_scaling_factor applied again; vLLM's fp16 guard divides both residual \
                 operands by it)",
                (hi / lo).max(lo / hi).abs()
            ),
        ],
        weight: None,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sum_weighing_one_input_twice_fits_its_weights() {
        let a: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..64).map(|i| (i as f32 * 0.11).cos()).collect();
        let c: Vec<f32> = (0..64).map(|i| ((i * i) as f32 * 0.05).sin()).collect();
        let y: Vec<f32> = (0..64).map(|k| 2.5 * a[k] + b[k] + c[k]).collect();
        let (w, misfit) = fit(&[a.clone(), b, c], &y).unwrap();
        assert!(
            (w[0] - 2.5).abs() < 1e-5 && (w[1] - 1.0).abs() < 1e-5,
            "{w:?}"
        );
        assert!(misfit < 1e-6);
        assert!(fit(&[a.clone(), a], &y).is_none(), "dependent inputs");
    }
}

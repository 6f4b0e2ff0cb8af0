//! `glmcheck endpoint --concurrency N`: each prompt asked again while N requests of glmcheck's
//! own run beside it, and its answer held against the one it had alone.
//!
//! The other requests are released together (one barrier) and the prompt with them or a few
//! milliseconds after ([`PROMPT_DELAYS`], one per round), so that a server that batches what
//! arrives together runs the prompt in the same steps as some of them, and behind them in the
//! batch's order: a request that leaks into others shows only in those batched after it. Their
//! prompts are made of the prompts' own token ids (valid ids for any server's vocabulary),
//! drawn at random, at half, once and one and a half times the prompt's length, and they ask
//! for as many tokens as the prompt does. The largest move over the rounds counts.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use serde_json::json;

use super::Served;
use crate::compare::server_drift::drift;
use crate::endpoint::client::Client;
use crate::report::endpoint::{ConcurrencyCheck, PromptDrift};
use crate::rng::SplitMix;

/// Per round, how long after the other requests the prompt is sent: with them, then just
/// behind them (queued in the same step), then later (beside their decoding, or the next step).
pub const PROMPT_DELAYS: [Duration; 3] = [
    Duration::ZERO,
    Duration::from_millis(5),
    Duration::from_millis(20),
];

/// What `--concurrency` needs besides the served answers.
pub(super) struct Load<'a> {
    pub client: &'a Client,
    pub served_model: &'a str,
    /// Requests sent beside each prompt.
    pub beside: usize,
    pub max_tokens: u32,
    pub tolerance: f64,
}

/// Ask every served prompt again beside `load.beside` other requests (`ask` asks one prompt
/// the way it was asked alone) and judge how far its answer moved.
pub(super) fn check(
    load: &Load,
    served: &[Served],
    ask: &(dyn Fn(Vec<u32>) -> anyhow::Result<Served> + Sync),
) -> anyhow::Result<ConcurrencyCheck> {
    let pool: Vec<u32> = served
        .iter()
        .flat_map(|s| s.tokens.iter().copied())
        .collect();
    let mut prompts = Vec::new();
    for (i, alone) in served.iter().enumerate() {
        let mut worst: Option<PromptDrift> = None;
        for (round, delay) in (1..).zip(PROMPT_DELAYS) {
            let seed = ((i as u64) << 32) | round as u64;
            let others = other_prompts(&pool, alone.tokens.len(), load.beside, seed);
            let loaded = beside_others(load, &others, delay, || ask(alone.tokens.clone()))
                .map_err(|e| e.context(format!("--concurrency: prompt {} beside others", i + 1)))?;
            let candidate = PromptDrift {
                index: i + 1,
                round,
                drift: drift(&alone.positions, &loaded.positions),
                continuation_differs_at: alone
                    .generated
                    .iter()
                    .zip(&loaded.generated)
                    .position(|(a, b)| a != b),
                seconds: loaded.seconds,
            };
            let larger = worst.as_ref().is_none_or(|w| {
                candidate.drift.max_abs_delta_logprob > w.drift.max_abs_delta_logprob
            });
            if larger {
                worst = Some(candidate);
            }
        }
        prompts.extend(worst);
    }
    Ok(ConcurrencyCheck::judge(
        load.beside,
        PROMPT_DELAYS.len(),
        load.tolerance,
        prompts,
    ))
}

/// `count` prompts of ids drawn from `pool`, at ½, 1 and 1½ times `length` in turn.
fn other_prompts(pool: &[u32], length: usize, count: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = SplitMix::new(seed);
    (0..count)
        .map(|j| {
            let n = (length * (j % 3 + 1)).div_ceil(2).max(1);
            (0..n)
                .map(|_| pool[(rng.next_u64() % pool.len() as u64) as usize])
                .collect()
        })
        .collect()
}

/// `probe()`'s answer, asked `delay` after `others` are sent to the server's completion API, all
/// released together; an error if any of them fails.
fn beside_others(
    load: &Load,
    others: &[Vec<u32>],
    delay: Duration,
    probe: impl FnOnce() -> anyhow::Result<Served>,
) -> anyhow::Result<Served> {
    let start = Barrier::new(others.len() + 1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = others
            .iter()
            .map(|tokens| {
                let start = &start;
                scope.spawn(move || {
                    start.wait();
                    let request = json!({
                        "model": load.served_model,
                        "prompt": tokens,
                        "max_tokens": load.max_tokens,
                        "temperature": 0,
                    });
                    load.client.post_json("/v1/completions", &request)
                })
            })
            .collect();
        start.wait();
        std::thread::sleep(delay);
        let began = Instant::now();
        let answer = probe().map(|mut s| {
            s.seconds = began.elapsed().as_secs_f64();
            s
        });
        for (j, h) in handles.into_iter().enumerate() {
            h.join()
                .map_err(|_| anyhow!("request {} beside the prompt: its thread panicked", j + 1))?
                .map_err(|e| anyhow!("request {} beside the prompt failed: {e}", j + 1))?;
        }
        answer
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_prompts_are_drawn_from_the_pool_at_three_lengths_and_repeat_by_seed() {
        let pool = [4, 8, 15, 16, 23, 42];
        let p = other_prompts(&pool, 6, 4, 7);
        assert_eq!(p.iter().map(Vec::len).collect::<Vec<_>>(), vec![3, 6, 9, 3]);
        assert!(p.iter().flatten().all(|t| pool.contains(t)));
        assert_eq!(p, other_prompts(&pool, 6, 4, 7));
        assert_ne!(p, other_prompts(&pool, 6, 4, 8));
    }
}

//! A running inference server seen from outside (`glmcheck endpoint`): the HTTP client
//! ([`client`]) and the two wire formats it speaks, each reading its answers back into the same
//! [`openai::Answer`] (token ids and per-position top-k log-probabilities):
//!
//! * [`openai`]: the OpenAI completion API as vLLM serves it, which gives every prompt
//!   position's top-k in one request;
//! * [`llama_server`]: llama.cpp's `llama-server`, whose native `/completion` gives only the
//!   next token's top-k, so each prompt position is one request on a growing prefix.
//!
//! What the answer is compared with is `compare::top_k`'s business.

use serde::Serialize;

pub mod client;
pub mod llama_server;
pub mod openai;

/// Which API a server speaks, found once per run ([`llama_server::is_props`] on its `/props`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Api {
    /// `/v1/completions` with vLLM's `prompt_logprobs` (vLLM).
    #[serde(rename = "openai")]
    OpenAi,
    /// `/completion` with `n_probs`, one request per prompt position (llama.cpp).
    LlamaServer,
}

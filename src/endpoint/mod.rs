//! A running OpenAI-compatible server seen from outside (`glmcheck endpoint`): the HTTP client
//! ([`client`]) and the completion API's wire format ([`openai`]): the request that asks for the
//! top-k log-probabilities at every prompt position, and the answer read back into token ids
//! and log-probabilities. What the answer is compared with is `compare::top_k`'s business.

pub mod client;
pub mod openai;

//! The model description of the MLA/MoE family (GLM-5 and its DeepSeek relatives):
//! configuration, family members, weight names, tensor schema, kv_b layout, stage names and
//! catalogue.

pub mod config;
pub mod family;
pub mod gguf_config;
mod hf_json;
pub mod kv_b;
pub mod names;
pub mod schema;
pub mod stage;
pub mod stages;
pub mod switches;
pub mod tokenize;

pub use config::Glm5Config;
pub use stage::Stage;

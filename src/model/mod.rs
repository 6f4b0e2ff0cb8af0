//! The GLM-5 model description: configuration, weight names, tensor schema, kv_b layout.

pub mod config;
pub mod kv_b;
pub mod names;
pub mod schema;

pub use config::Glm5Config;

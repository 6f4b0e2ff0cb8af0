//! The GLM-5 model description: configuration, weight names, tensor schema, kv_b layout, stage catalogue.

pub mod config;
pub mod kv_b;
pub mod names;
pub mod schema;
pub mod stages;

pub use config::Glm5Config;

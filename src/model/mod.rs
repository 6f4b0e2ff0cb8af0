//! The GLM-5 model description: configuration, weight names, tensor schema, kv_b layout, stage
//! names and catalogue.

pub mod config;
pub mod kv_b;
pub mod names;
pub mod schema;
pub mod stage;
pub mod stages;
pub mod tokenize;

pub use config::Glm5Config;
pub use stage::Stage;

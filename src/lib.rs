//! glmcheck: finds why a large language model prints garbage.
//!
//! The library holds everything the `glmcheck` binary does; the binary only parses arguments.

pub mod model;
pub mod weights;

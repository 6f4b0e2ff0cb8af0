//! What every backend builds on to hold a weight: where a matrix lies in its file and a rank's
//! block of it as whole GGML blocks (`stored`), and the memory budgets that kept weights claim
//! (`claim`).

pub mod claim;
pub mod stored;

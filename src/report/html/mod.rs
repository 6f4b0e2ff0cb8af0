//! The comparison as one self-contained HTML file: no network, no JavaScript, only inline CSS
//! and SVG. A verdict banner, the fault with its evidence, the per-layer divergence plot
//! (`rel_diff` on a log axis, cosine and norm ratio, one series per stage kind, the first
//! divergence marked), the logits (health, a histogram of the last position's logits and the
//! entropy per position, reference against candidate) and the stage tables.
//!
//! `page` lays out the document; `divergence` and `logits` draw the charts on the axes and
//! primitives of `svg`; `tables` writes the stage tables.

mod divergence;
mod logits;
mod page;
pub(crate) mod svg;
mod tables;

pub(crate) use page::CSS;
pub use page::{esc, html};

/// The `id` of the divergence plot's `<svg>`.
pub const PLOT_ID: &str = "divergence-plot";
/// The `id` of the logits histogram's `<svg>`.
pub const HISTOGRAM_ID: &str = "logits-histogram";
/// The fill of the divergence plot's panels, and nowhere else on the page.
pub const PLOT_BACKGROUND: [u8; 3] = [0xfb, 0xfa, 0xf2];
/// The stroke and marker colour of the plot's first series (`L*.out` when the traces hold it),
/// and nowhere else on the page but the legend.
pub const PRIMARY_STROKE: [u8; 3] = [0xe4, 0x00, 0x7c];
/// The band behind the first divergent column in every panel.
pub const DIVERGENCE_BAND: [u8; 3] = [0xff, 0xcf, 0xd6];

//! Terminal output helpers shared by the commands' tables: byte sizes, shapes and the project's
//! table look.

use comfy_table::{presets::UTF8_FULL_CONDENSED, ContentArrangement, Table};

/// `1.23 GiB`, `512 B`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// `[64, 512, 192]`.
pub fn shape(s: &[u64]) -> String {
    format!("{s:?}")
}

/// A table with the project's look.
pub fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_header(header.iter().copied());
    t
}

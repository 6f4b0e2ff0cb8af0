//! The HTML report as headless Chromium renders it (`scripts/setup-chromium`).

#[path = "../common/mod.rs"]
mod common;

mod diff_reports;

//! `glmcheck diff --markdown` and `--html OUT` on a real failing comparison: a synthetic GLM-5
//! whose layer 3 overflows f16, run by the reference in f32 and in emulated f16. The Markdown
//! must carry the verdict, the first divergence and the fault with its evidence; the HTML must be
//! one self-contained file that headless Chromium renders with no console message, and whose
//! screenshot shows the divergence plot with its data and the first divergence marked.
//!
//! Chromium is Debian's `chromium` (`scripts/setup-chromium` installs it when it can); these
//! tests fail, not skip, without it. `GLMCHECK_CHROMIUM` names another binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::common::glmcheck_bin;
use glmcheck::report::html::{DIVERGENCE_BAND, PLOT_BACKGROUND, PLOT_ID, PRIMARY_STROKE};
use glmcheck::report::markdown::{code, text};

const TOKENS: &str = "39,100,7,200,5,6,7,8,9,10,11,12";

fn glmcheck<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    Command::new(glmcheck_bin())
        .args(args)
        .output()
        .expect("start glmcheck")
}

fn ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The traces every test compares, made once: (folder, f32 reference, f16 candidate).
fn traces() -> &'static (PathBuf, PathBuf, PathBuf) {
    static TRACES: OnceLock<(PathBuf, PathBuf, PathBuf)> = OnceLock::new();
    TRACES.get_or_init(|| {
        // One folder per test process (the target folder may be shared), kept after the run so
        // that report.html and report.png can be looked at; those of ended processes go.
        let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        for e in std::fs::read_dir(&base).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name
                .strip_prefix("diff_reports-")
                .and_then(|p| p.parse::<u32>().ok())
            {
                if !Path::new(&format!("/proc/{pid}")).exists() {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let dir = base.join(format!("diff_reports-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let model = dir.join("model");
        let out = glmcheck(
            [
                "synth",
                "--format",
                "hf",
                "--layers",
                "6",
                "--fp16-overflow",
                "3",
                "--set",
                "index_n_heads=16",
                "--out",
            ]
            .map(std::ffi::OsString::from)
            .into_iter()
            .chain([model.clone().into_os_string()]),
        );
        ok(&out, "glmcheck synth");
        let run = |extra: &[&str], name: &str| {
            let trace = dir.join(name);
            let mut args: Vec<std::ffi::OsString> = vec!["run".into(), model.clone().into()];
            for a in ["--tokens", TOKENS, "--full", "**"].iter().chain(extra) {
                args.push(a.into());
            }
            args.push("--out".into());
            args.push(trace.clone().into());
            ok(&glmcheck(args), &format!("glmcheck run {extra:?}"));
            trace
        };
        // f16 without vLLM's residual rescaling: the stream overflows at layer 3.
        let f16 = ["--dtype", "f16", "--inject", "fp16-overflow"];
        let (a, b) = (run(&[], "ref.trace"), run(&f16, "cand.trace"));
        (dir, a, b)
    })
}

fn json_of(reference: &Path, candidate: &Path) -> serde_json::Value {
    let out = glmcheck([
        "diff".as_ref(),
        reference.as_os_str(),
        candidate.as_os_str(),
        "--json".as_ref(),
    ]);
    assert_eq!(out.status.code(), Some(1), "the f16 candidate fails");
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn markdown_carries_the_verdict_the_first_divergence_and_the_fault() {
    let (_, a, b) = traces();
    let json = json_of(a, b);
    let out = glmcheck([
        "diff".as_ref(),
        a.as_os_str(),
        b.as_os_str(),
        "--markdown".as_ref(),
    ]);
    assert_eq!(out.status.code(), Some(1), "exit codes do not change");
    let md = String::from_utf8(out.stdout).unwrap();

    assert!(md.starts_with("### ❌ glmcheck diff: **FAIL**"), "{md}");
    let stage = json["first_divergence"]["stage"].as_str().unwrap();
    assert!(
        md.contains(&format!("**First divergence:** {}", code(stage))),
        "{md}"
    );
    let fault = &json["fault"];
    assert_eq!(
        fault["class"], "dtype_overflow",
        "the synth model overflows f16 at layer 3"
    );
    assert!(
        md.contains(&format!(
            "**Fault:** {} — {}",
            code("dtype_overflow"),
            text(fault["summary"].as_str().unwrap())
        )),
        "{md}"
    );
    for e in fault["evidence"].as_array().unwrap() {
        assert!(
            md.contains(&format!("- {}", text(e.as_str().unwrap()))),
            "{md}"
        );
    }
    assert!(md.contains("**Logits:** reference entropy"), "{md}");
    // One row per layer (6), one for embed, one for final_norm and logits.
    let table_rows = md
        .lines()
        .skip_while(|l| !l.starts_with("| layer |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .count();
    assert_eq!(table_rows, 8, "{md}");
    assert!(
        md.lines()
            .any(|l| l.starts_with("| 3 |") && l.contains("◀ first")),
        "layer 3 holds the first divergence:\n{md}"
    );
    assert!(md.contains(&format!("| ▶ {} |", code(stage))), "{md}");

    // A trace against itself passes, with nothing to blame.
    let out = glmcheck([
        "diff".as_ref(),
        a.as_os_str(),
        a.as_os_str(),
        "--markdown".as_ref(),
    ]);
    assert_eq!(out.status.code(), Some(0));
    let md = String::from_utf8(out.stdout).unwrap();
    assert!(md.starts_with("### ✅ glmcheck diff: **PASS**"), "{md}");
    assert!(md.contains("**First divergence:** none"), "{md}");
}

#[test]
fn html_is_one_file_with_nothing_to_fetch() {
    let (dir, a, b) = traces();
    let out_path = dir.join("static.html");
    let out = glmcheck([
        "diff".as_ref(),
        a.as_os_str(),
        b.as_os_str(),
        "--html".as_ref(),
        out_path.as_os_str(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        stdout.starts_with("FAIL:"),
        "the table still prints: {stdout}"
    );
    let html = std::fs::read_to_string(&out_path).unwrap();
    assert!(html.starts_with("<!DOCTYPE html>"));
    for banned in [
        "http:", "https:", "<script", "<link", " src=", "url(", "@import", "<iframe", "<img",
    ] {
        assert!(!html.contains(banned), "the report holds {banned:?}");
    }
    for id in [
        PLOT_ID,
        "logits-histogram",
        "entropy-plot",
        "first-divergence",
    ] {
        assert!(html.contains(&format!("id=\"{id}\"")), "no #{id}");
    }
    assert!(html.contains("dtype_overflow"));
}

#[test]
fn strings_from_traces_are_escaped() {
    let (dir, a, b) = traces();
    // Copies whose folder names and one stage's name hold markup.
    let hostile = "L3.moe.shared<img src=x onerror=alert(1)>|*_$";
    let copy = |from: &Path, name: &str| {
        let to = dir.join(name);
        let _ = std::fs::remove_dir_all(&to);
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
        let manifest = to.join("manifest.json");
        let mut m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
        for s in m["stages"].as_array_mut().unwrap() {
            if s["name"] == "L3.moe.shared" {
                s["name"] = hostile.into();
            }
        }
        std::fs::write(&manifest, serde_json::to_vec(&m).unwrap()).unwrap();
        to
    };
    let (ra, rb) = (copy(a, "<b>ref.trace"), copy(b, "cand<i>.trace"));
    let out_path = dir.join("hostile.html");
    let out = glmcheck([
        "diff".as_ref(),
        ra.as_os_str(),
        rb.as_os_str(),
        "--markdown".as_ref(),
        "--html".as_ref(),
        out_path.as_os_str(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let md = String::from_utf8(out.stdout).unwrap();
    assert!(md.contains("L3.moe.shared<img"), "inside a code span: {md}");
    for line in md.lines() {
        // Markup only inside code spans, where Markdown renders no HTML.
        let outside: String = line.split('`').step_by(2).collect();
        for tag in ["<img", "<b>", "<i>"] {
            assert!(!outside.contains(tag), "raw {tag} outside code: {line}");
        }
    }
    let html = std::fs::read_to_string(&out_path).unwrap();
    assert!(!html.contains("<img") && !html.contains("<b>") && !html.contains("<i>"));
    assert!(html.contains("L3.moe.shared&lt;img src=x onerror=alert(1)&gt;|*_$"));
    assert!(html.contains("&lt;b&gt;ref.trace") && html.contains("cand&lt;i&gt;.trace"));
}

#[test]
fn bad_output_paths_and_flag_clashes_exit_2() {
    let (dir, a, b) = traces();
    let out = glmcheck([
        "diff".as_ref(),
        a.as_os_str(),
        b.as_os_str(),
        "--html".as_ref(),
        dir.join("no/such/folder/r.html").as_os_str(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(
        err.contains("r.html") && err.contains("HTML report"),
        "{err}"
    );
    let out = glmcheck([
        "diff".as_ref(),
        a.as_os_str(),
        b.as_os_str(),
        "--markdown".as_ref(),
        "--json".as_ref(),
    ]);
    assert_eq!(out.status.code(), Some(2));

    let help = glmcheck(["diff", "--help"]);
    ok(&help, "glmcheck diff --help");
    let help = String::from_utf8(help.stdout).unwrap();
    assert!(
        help.contains("--markdown") && help.contains("--html <OUT>"),
        "{help}"
    );
}

// ---------------------------------------------------------------------------------------------
// Headless Chromium

/// Debian's `chromium`, or `$GLMCHECK_CHROMIUM`; panics with how to install it.
fn chromium() -> PathBuf {
    if let Some(p) = std::env::var_os("GLMCHECK_CHROMIUM") {
        return PathBuf::from(p);
    }
    for name in ["chromium", "chromium-browser"] {
        for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
            let p = dir.join(name);
            if p.is_file() {
                return p;
            }
        }
    }
    panic!(
        "headless Chromium is missing: install Debian's `chromium` (apt-get install -y \
         chromium; scripts/setup-chromium does so as root) or set GLMCHECK_CHROMIUM"
    );
}

/// Run Chromium headless on `page` with `args`, killed after two minutes. Its output goes
/// through files: a pipe nobody reads while it runs would fill and stall it.
fn headless(page: &Path, profile: &Path, args: &[&str]) -> Output {
    let (out_path, err_path) = (
        profile.with_extension("stdout"),
        profile.with_extension("stderr"),
    );
    let mut child = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--hide-scrollbars",
            "--force-color-profile=srgb",
            "--force-device-scale-factor=1",
            "--enable-logging=stderr",
            "--log-level=0",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(format!("file://{}", page.display()))
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .expect("start chromium");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "chromium did not finish in 120 s:\n{}",
                std::fs::read_to_string(&err_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: std::fs::read(&out_path).unwrap(),
        stderr: std::fs::read(&err_path).unwrap(),
    }
}

/// The RGB pixels of a PNG: (width, height, 3 bytes a pixel).
fn decode_png(path: &Path) -> (usize, usize, Vec<u8>) {
    let mut decoder =
        png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
    decoder.set_transformations(png::Transformations::normalize_to_color8());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = info.color_type.samples();
    assert!(
        channels >= 3,
        "a colour screenshot, got {:?}",
        info.color_type
    );
    let (w, h) = (info.width as usize, info.height as usize);
    let mut rgb = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        let row = &buf[y * info.line_size..];
        for x in 0..w {
            rgb.extend_from_slice(&row[x * channels..x * channels + 3]);
        }
    }
    (w, h, rgb)
}

fn near(p: &[u8], c: [u8; 3], tol: u8) -> bool {
    p.iter().zip(c).all(|(&a, b)| a.abs_diff(b) <= tol)
}

#[test]
fn chromium_renders_the_divergence_plot() {
    let browser = chromium();
    let (dir, a, b) = traces();
    let page = dir.join("report.html");
    let out = glmcheck([
        "diff".as_ref(),
        a.as_os_str(),
        b.as_os_str(),
        "--html".as_ref(),
        page.as_os_str(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let profile = dir.join("chromium-profile");
    let shot = dir.join("report.png");
    let _ = std::fs::remove_file(&shot);

    // The DOM Chromium builds holds the plot's SVG with its data lines.
    let dom = headless(&page, &profile, &["--dump-dom"]);
    assert!(
        dom.status.success(),
        "{} --dump-dom failed:\n{}",
        browser.display(),
        String::from_utf8_lossy(&dom.stderr)
    );
    let dom_text = String::from_utf8_lossy(&dom.stdout);
    let plot_start = dom_text
        .find(&format!("<svg id=\"{PLOT_ID}\""))
        .unwrap_or_else(|| panic!("no #{PLOT_ID} in the DOM:\n{dom_text}"));
    let plot = &dom_text[plot_start..plot_start + dom_text[plot_start..].find("</svg>").unwrap()];
    assert!(
        plot.matches("<polyline").count() >= 6,
        "data lines in the plot"
    );

    // A screenshot: the plot's panels are drawn, with the first series' line across the
    // layers and the first divergence's band.
    let run = headless(
        &page,
        &profile,
        &[
            "--window-size=1280,1800",
            &format!("--screenshot={}", shot.display()),
        ],
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success() && shot.exists(),
        "{} --screenshot failed:\n{stderr}",
        browser.display()
    );
    // The page has no script, so any console message is an error of the page itself.
    let console: Vec<&str> = stderr.lines().filter(|l| l.contains(":CONSOLE")).collect();
    assert!(console.is_empty(), "console messages: {console:#?}");

    let (w, h, rgb) = decode_png(&shot);
    let px = |x: usize, y: usize| &rgb[(y * w + x) * 3..(y * w + x) * 3 + 3];
    let (mut x0, mut y0, mut x1, mut y1) = (usize::MAX, usize::MAX, 0, 0);
    for y in 0..h {
        for x in 0..w {
            if near(px(x, y), PLOT_BACKGROUND, 1) {
                (x0, y0, x1, y1) = (x0.min(x), y0.min(y), x1.max(x), y1.max(y));
            }
        }
    }
    assert!(
        x0 < x1 && y0 < y1,
        "no pixel of the plot's background {PLOT_BACKGROUND:?} in {}",
        shot.display()
    );
    let (pw, ph) = (x1 - x0 + 1, y1 - y0 + 1);
    assert!(
        pw >= 600 && ph >= 400,
        "the plot's panels span {pw}×{ph} px, expected the whole plot"
    );
    let (mut n, mut sx0, mut sx1, mut band) = (0usize, usize::MAX, 0usize, 0usize);
    for y in y0..=y1 {
        for x in x0..=x1 {
            let p = px(x, y);
            if near(p, PRIMARY_STROKE, 12) {
                n += 1;
                (sx0, sx1) = (sx0.min(x), sx1.max(x));
            }
            band += usize::from(near(p, DIVERGENCE_BAND, 2));
        }
    }
    assert!(
        n >= 200,
        "{n} pixels of the first series' colour {PRIMARY_STROKE:?} in the plot ({pw}×{ph} at \
         {x0},{y0})"
    );
    // L*.out runs over layers 0–5: 5/9 of the columns (embed, 6 layers, final_norm, logits).
    assert!(
        (sx1 - sx0) * 5 >= pw * 2,
        "the series spans {} of {pw} px",
        sx1 - sx0
    );
    assert!(band >= 2000, "the first divergence's band: {band} px");
}

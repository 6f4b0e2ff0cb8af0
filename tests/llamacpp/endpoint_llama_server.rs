//! `glmcheck endpoint` against llama.cpp's own `llama-server` (built by `scripts/setup-llamacpp`),
//! serving glmcheck's synthetic GGUF and one made by llama.cpp's converter, honest and with
//! faults planted in the file's bytes: a metadata value (the RoPE base, the routed experts'
//! scale) or a weight.
//!
//! The server is asked through its native `/completion`, one request per prompt position. With
//! an F32 KV cache and flash attention off it computes what glmcheck's reference does to a few
//! 1e-6 nats; with its defaults (F16 KV cache, flash attention auto) to about 1e-3, well inside
//! the default tolerance.

use crate::common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Twelve prompt ids below the synthetic vocabulary (384).
const TOKENS: &str = "1,5,9,14,20,33,100,7,200,31,64,3";

/// A running llama-server on a free port, killed when dropped.
struct Server {
    child: Child,
    url: String,
}

impl Server {
    /// `llama-server -m GGUF` on one slot and two threads; `exact`: F32 KV cache and flash
    /// attention off, else the server's defaults. Ready when `/health` answers 200.
    fn start(gguf: &Path, exact: bool, log: &Path) -> Server {
        Server::with_slots(gguf, exact, log, 1)
    }

    /// [`Server::start`] with `slots` sequences decoded together (`-np`).
    fn with_slots(gguf: &Path, exact: bool, log: &Path, slots: u32) -> Server {
        let bin = common::root().join(".oracles/llama.cpp/build/tools/server/llama-server");
        assert!(
            bin.exists(),
            "{} is not built: run scripts/setup-llamacpp (scripts/test does)",
            bin.display()
        );
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut cmd = Command::new(bin);
        cmd.arg("-m")
            .arg(gguf)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "-c",
                "256",
                "-np",
                &slots.to_string(),
                "-t",
                "2",
                "--no-webui",
            ]);
        if exact {
            cmd.args([
                "--cache-type-k",
                "f32",
                "--cache-type-v",
                "f32",
                "-fa",
                "off",
            ]);
        }
        let out = std::fs::File::create(log).expect("the server's log");
        let child = cmd
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out))
            .spawn()
            .expect("start llama-server");
        let mut server = Server {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        let began = Instant::now();
        while !health_ok(port) {
            let log_text = || std::fs::read_to_string(log).unwrap_or_default();
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("llama-server exited ({status}):\n{}", log_text());
            }
            assert!(
                began.elapsed() < Duration::from_secs(60),
                "llama-server not ready after 60 s:\n{}",
                log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether `GET /health` on `port` answers 200.
fn health_ok(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let mut answer = String::new();
    s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .and_then(|_| s.read_to_string(&mut answer))
        .is_ok()
        && answer.starts_with("HTTP/1.1 200")
}

/// glmcheck's synthetic GGUF (F32) in `dir`.
fn synth(dir: &Path) -> PathBuf {
    let gguf = dir.join("synth.gguf");
    common::synth_tiny(&gguf, &[]);
    gguf
}

/// A copy of `gguf` with one value rewritten in its bytes by the `gguf` package: a metadata
/// key's (`key`) or every element of a tensor's multiplied (`tensor`).
fn planted(gguf: &Path, what: &str, name: &str, value: &str) -> PathBuf {
    let out = gguf.with_file_name(format!("planted-{name}.gguf"));
    std::fs::copy(gguf, &out).unwrap();
    const PLANT: &str = "import sys
from gguf import GGUFReader
path, what, name, value = sys.argv[1:5]
r = GGUFReader(path, 'r+')
if what == 'key':
    f = r.fields[name]
    f.parts[f.data[0]][0] = float(value)
else:
    t = next(t for t in r.tensors if t.name == name)
    t.data[...] *= float(value)
r.data.flush()
";
    let run = Command::new(common::python())
        .args(["-c", PLANT])
        .arg(&out)
        .args([what, name, value])
        .output()
        .expect("start python");
    assert!(
        run.status.success(),
        "planting {name} = {value}: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    out
}

/// `glmcheck endpoint URL MODEL --tokens TOKENS --json EXTRA…`, its exit code asserted.
fn endpoint(server: &Server, model: &Path, extra: &[&str], code: i32) -> Value {
    let mut args = vec![
        "endpoint",
        &server.url,
        model.to_str().unwrap(),
        "--tokens",
        TOKENS,
        "--top-k",
        "20",
        "--max-tokens",
        "4",
        "--json",
    ];
    args.extend(extra);
    common::glmcheck_json(args, code)
}

/// The one prompt's comparison.
fn comparison(report: &Value) -> &Value {
    &report["prompts"][0]["comparison"]
}

fn max_delta(report: &Value) -> f64 {
    comparison(report)["max_abs_delta_logprob"]
        .as_f64()
        .unwrap()
}

#[test]
fn an_honest_server_agrees_exactly_and_within_the_tolerance_on_its_defaults() {
    let dir = common::scratch();
    let gguf = synth(dir.path());
    let exact = Server::start(&gguf, true, &dir.path().join("exact.log"));
    let r = endpoint(&exact, &gguf, &[], 0);
    assert_eq!(r["api"], "llama-server", "{r:#}");
    let prompt = &r["prompts"][0];
    assert_eq!(comparison(&r)["positions"], 12);
    assert_eq!(prompt["continuation"], prompt["reference_continuation"]);
    let exact_delta = max_delta(&r);
    assert!(
        exact_delta < 1e-4,
        "F32 KV cache: max |Δ logprob| {exact_delta}"
    );
    drop(exact);

    let defaults = Server::start(&gguf, false, &dir.path().join("defaults.log"));
    let r = endpoint(&defaults, &gguf, &[], 0);
    let default_delta = max_delta(&r);
    // The F16 KV cache moves the log-probabilities by about 1e-3: more than F32, far below 0.5.
    assert!(
        default_delta > exact_delta && default_delta < 1e-2,
        "defaults: max |Δ logprob| {default_delta} (F32: {exact_delta})"
    );
}

/// Four slots decoding together: the prompt's numbers beside three other requests are its
/// numbers alone, so the server is not accused.
#[test]
fn a_server_decoding_several_requests_together_keeps_each_ones_numbers() {
    let dir = common::scratch();
    let gguf = synth(dir.path());
    let server = Server::with_slots(&gguf, true, &dir.path().join("slots.log"), 4);
    let r = endpoint(
        &server,
        &gguf,
        &["--concurrency", "3", "--kv-type", "f32"],
        0,
    );
    let c = &r["concurrency"];
    assert_eq!(c["verdict"], "pass", "{c:#}");
    let drift = c["prompts"][0]["drift"]["max_abs_delta_logprob"]
        .as_f64()
        .unwrap();
    eprintln!("llama-server, 4 slots: largest move beside 3 others {drift:e} nats");
    assert!(drift < 1e-3, "{c:#}");
}

#[test]
fn a_gguf_from_llama_cpps_converter_agrees_exactly() {
    let dir = common::scratch();
    let src = common::root().join(".oracles/llama.cpp/src");
    let out = common::run_oracle(
        "llamacpp.model",
        &[
            dir.path().to_str().unwrap(),
            "--llama-cpp",
            src.to_str().unwrap(),
            "--rms-norm-eps",
            "1e-5",
        ],
    );
    let made: Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let gguf = PathBuf::from(made["gguf"].as_str().unwrap());
    let server = Server::start(&gguf, true, &dir.path().join("server.log"));
    let r = endpoint(&server, &gguf, &[], 0);
    let delta = max_delta(&r);
    assert!(delta < 1e-4, "max |Δ logprob| {delta}");
    let prompt = &r["prompts"][0];
    assert_eq!(prompt["continuation"], prompt["reference_continuation"]);
}

#[test]
fn a_rope_base_planted_in_the_metadata_parts_where_rotation_first_matters() {
    let dir = common::scratch();
    let gguf = synth(dir.path());
    let bad = planted(&gguf, "key", "glm-dsa.rope.freq_base", "10000");
    let server = Server::start(&bad, true, &dir.path().join("server.log"));
    let r = endpoint(&server, &gguf, &[], 1);
    let c = comparison(&r);
    // Position 0 attends to itself only, where every RoPE base rotates by 0.
    let first = c["per_position"][0]["max_abs_delta_logprob"]
        .as_f64()
        .unwrap();
    assert!(first < 1e-4, "position 0: {first}");
    assert_eq!(c["first_parting"]["position"], 1, "{c:#}");
}

#[test]
fn a_weight_planted_in_the_file_parts_from_the_first_position() {
    let dir = common::scratch();
    let gguf = synth(dir.path());
    let bad = planted(&gguf, "tensor", "blk.0.attn_output.weight", "1.5");
    let server = Server::start(&bad, true, &dir.path().join("server.log"));
    let r = endpoint(&server, &gguf, &[], 1);
    assert_eq!(comparison(&r)["first_parting"]["position"], 0, "{r:#}");
    assert!(max_delta(&r) > 1.0, "{}", max_delta(&r));
}

/// `expert_weights_scale` squared in the file: llama-server scales the routed experts' output by
/// the factor twice over, what the catalogue's `routed-scale-twice` computes.
#[test]
fn explain_names_the_routed_scale_applied_twice() {
    let dir = common::scratch();
    let gguf = synth(dir.path());
    let bad = planted(&gguf, "key", "glm-dsa.expert_weights_scale", "6.25");
    let server = Server::start(&bad, true, &dir.path().join("server.log"));
    let r = endpoint(&server, &gguf, &["--explain"], 1);
    let e = &r["explanation"];
    assert_eq!(e["best"]["name"], "routed-scale-twice", "{e:#}");
    assert_eq!(e["verdict"], "explained", "{e:#}");
    let best = e["best"]["score"].as_f64().unwrap();
    let clean = common::explain_score(e, "clean");
    assert!(best < 1e-4 && clean > 1.0, "best {best}, clean {clean}");
}

#[test]
fn a_position_the_server_refuses_is_one_line_naming_it() {
    let dir = common::scratch();
    let gguf = synth(dir.path());
    let server = Server::start(&gguf, true, &dir.path().join("server.log"));
    // 999 is past the vocabulary (384): the request on the first three ids is refused.
    let out = common::glmcheck_output(&[
        "endpoint",
        &server.url,
        gguf.to_str().unwrap(),
        "--tokens",
        "1,5,999,7",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    let url = format!("{}/completion", server.url);
    assert!(
        err.contains(&url) && err.contains("at position 2 of 4"),
        "{err}"
    );
}

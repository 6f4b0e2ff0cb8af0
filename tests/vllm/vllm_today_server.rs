//! `vllm_capture` from outside a running vLLM 0.32 server (`--server URL`), and the captures
//! that cannot be made: one line and exit code 2, before or instead of starting vLLM.

use crate::common;
use crate::vllm32::{bisect, evidence, model, vllm_python, TOKENS};

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

/// A `vllm serve` process (vLLM's OpenAI server module: the `vllm` command of the CPU build looks
/// itself up under the distribution name `vllm` and fails), killed with its engine and workers
/// when dropped.
pub(crate) struct Server {
    child: std::process::Child,
    pub(crate) url: String,
}

impl Server {
    /// The server on `model` at `tp` with the probe's worker extension, vLLM's dev mode (which
    /// opens `/collective_rpc`), glmcheck's plugin writing shard manifests to `shards`, and the
    /// tests' `fault` planted, one request at a time; ready when `/health` answers.
    pub(crate) fn start(model: &Path, tp: u64, shards: &Path, fault: &str) -> Server {
        Server::launch(model, tp, shards, fault, 1)
    }

    /// [`Server::start`], batching up to 8 requests in a step (whole prompts: the prefills of
    /// requests that arrive together run in one forward).
    pub(crate) fn start_batching(model: &Path, tp: u64, shards: &Path, fault: &str) -> Server {
        Server::launch(model, tp, shards, fault, 8)
    }

    fn launch(model: &Path, tp: u64, shards: &Path, fault: &str, max_num_seqs: u32) -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = std::fs::File::create(shards.with_extension("log")).unwrap();
        let child = Command::new(vllm_python())
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "--tensor-parallel-size",
                &tp.to_string(),
                "--dtype",
                "float32",
            ])
            .args(["--enforce-eager", "--attention-backend", "CPU_MLA"])
            .args(["-cc", r#"{"custom_ops":["-rotary_embedding"]}"#])
            .args(["--max-model-len", "256", "--max-num-batched-tokens", "256"])
            .args(["--max-num-seqs", &max_num_seqs.to_string()])
            .arg("--skip-tokenizer-init")
            .args([
                "--worker-extension-cls",
                "glmcheck_probe.vllm_worker.ProbeWorker",
            ])
            .env("VLLM_SERVER_DEV_MODE", "1")
            .env("GLMCHECK_SHARDS_DIR", shards)
            .env("GLMCHECK_VLLM_FAULT", fault)
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_CPU_OMP_THREADS_BIND", "0|1")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("start vLLM's server");
        let server = Server {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() || !server.healthy() {
            assert!(
                started.elapsed().as_secs() < 300,
                "vLLM's server not ready in 300 s: {}",
                std::fs::read_to_string(shards.with_extension("log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_secs(2));
        }
        server
    }

    fn healthy(&self) -> bool {
        let probe = format!(
            "import urllib.request; urllib.request.urlopen('{}/health', timeout=5)",
            self.url
        );
        Command::new(vllm_python())
            .args(["-c", &probe])
            .output()
            .is_ok_and(|o| o.status.success())
    }
}

impl Drop for Server {
    /// SIGTERM to the server's process group (vLLM's engine and workers), SIGKILL after 30 s.
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let signal = |s: &str| Command::new("kill").args([s, "--", &group]).status();
        let _ = signal("-TERM");
        for _ in 0..30 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        let _ = signal("-KILL");
        let _ = self.child.wait();
    }
}

#[test]
fn a_running_vllm_server_is_captured_from_outside_and_the_unsharded_kv_b_found() {
    let dir = common::scratch();
    let hf = model(dir.path());
    let shards = dir.path().join("server-shards");
    let server = Server::start(&hf, 2, &shards, "unsharded-kv-b");
    let out = dir.path().join("served");
    let run = Command::new(vllm_python())
        .args(["-m", "glmcheck_probe.vllm_capture", "--server", &server.url])
        .args(["--tokens", TOKENS])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("start vllm_capture");
    drop(server);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let summary: Value = serde_json::from_slice(
        String::from_utf8_lossy(&run.stdout)
            .lines()
            .last()
            .unwrap()
            .as_bytes(),
    )
    .unwrap();
    assert_eq!(summary["tp"], 2);
    assert_eq!(summary["model"], hf.to_str().unwrap());
    let v = bisect(&hf, &out);
    assert_eq!(v["fault"]["class"], "unsharded_weight", "{v:#}");
    assert!(
        evidence(&v).contains("on rank 1 holds rows 0..256 of 512"),
        "{v:#}"
    );
}

/// What a capture cannot be made from: one line naming it, exit code 2, before or instead of
/// starting vLLM.
#[test]
fn a_capture_that_cannot_be_made_is_one_line_and_exit_2() {
    let dir = common::scratch();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let server = format!("http://127.0.0.1:{port}");
    let taken = dir.path().join("taken");
    std::fs::create_dir_all(taken.join("ranks")).unwrap();
    let cases: [(Vec<&str>, String); 9] = [
        (
            vec!["--server", &server, "--tokens", TOKENS],
            format!("vllm_capture: {server}/v1/models: "),
        ),
        (
            vec!["model", "--tokens", "1,x"],
            "vllm_capture: --tokens '1,x': not comma-separated integers".into(),
        ),
        (
            vec!["--tokens", TOKENS],
            "vllm_capture: give MODEL, or --server URL of a running vLLM".into(),
        ),
        (
            vec!["model", "--server", &server, "--tokens", TOKENS],
            "vllm_capture: --server: model: the model and engine arguments".into(),
        ),
        (
            vec![
                "--server",
                &server,
                "--tokens",
                TOKENS,
                "--out",
                taken.to_str().unwrap(),
            ],
            format!("vllm_capture: {}: already holds files", taken.display()),
        ),
        (
            vec!["--server", &server, "--tree", "cuda", "--tokens", TOKENS],
            "vllm_capture: --server: --tree cuda: the model and engine arguments".into(),
        ),
        (
            vec![
                "model",
                "--tp",
                "2",
                "--tensor-parallel-size",
                "4",
                "--tokens",
                TOKENS,
            ],
            "vllm_capture: --tp 2 and --tensor-parallel-size 4 disagree; give one".into(),
        ),
        (
            vec!["model"],
            "vllm_capture: give the prompt: --tokens IDS or --prompt TEXT (or --shards-only)"
                .into(),
        ),
        (
            vec!["model", "--shards-only", "--tokens", TOKENS],
            "vllm_capture: --shards-only runs no prompt".into(),
        ),
    ];
    for (args, expected) in cases {
        let run = Command::new(vllm_python())
            .args(["-m", "glmcheck_probe.vllm_capture"])
            .args(&args)
            .args(
                (!args.contains(&"--out"))
                    .then_some(["--out", dir.path().join("none").to_str().unwrap()])
                    .into_iter()
                    .flatten(),
            )
            .output()
            .expect("start vllm_capture");
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with(&expected), "{args:?}: {stderr}");
    }
}

//! A small blocking HTTP client for an inference server: JSON in, JSON text out, every call
//! bounded by one deadline, connection failures and 5xx answers tried again with a backoff.
//! Plain HTTP only (no TLS is built in).

use std::time::{Duration, Instant};

use thiserror::Error;

/// How often a failed call is tried again (connection refused or reset, a 5xx answer).
pub const RETRIES: u32 = 2;

/// The wait before the first retry; doubled before each next one.
pub const BACKOFF: Duration = Duration::from_millis(500);

/// The largest answer read (a long prompt's top-k at every position is a few MB).
const MAX_ANSWER_BYTES: u64 = 256 << 20;

/// Why a call gave no usable answer. Each names the URL it was for.
#[derive(Debug, Error)]
pub enum CallError {
    #[error("{url}: not a plain http:// URL (no TLS in this build)")]
    Scheme { url: String },
    #[error("{url}: no answer within {seconds} s (--timeout)")]
    Timeout { url: String, seconds: u64 },
    #[error("{url}: HTTP {status}: {message}")]
    Status {
        url: String,
        status: u16,
        message: String,
    },
    #[error("{url}: {reason}")]
    Transport { url: String, reason: String },
}

/// A server at one base URL, with one deadline for everything asked of it.
pub struct Client {
    base: String,
    deadline: Instant,
    timeout: Duration,
}

impl Client {
    /// A client for `base` (`http://host:port`, with or without a trailing `/v1`) whose calls,
    /// retries and backoff included, all end within `timeout` from now.
    pub fn new(base: &str, timeout: Duration) -> Result<Client, CallError> {
        let trimmed = base.trim_end_matches('/');
        let trimmed = trimmed.strip_suffix("/v1").unwrap_or(trimmed);
        if !trimmed.starts_with("http://") || trimmed.len() <= "http://".len() {
            return Err(CallError::Scheme { url: base.into() });
        }
        Ok(Client {
            base: trimmed.to_string(),
            deadline: Instant::now() + timeout,
            timeout,
        })
    }

    /// The full URL of `path` (`/v1/completions`).
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `GET path`: the answer's body.
    pub fn get(&self, path: &str) -> Result<String, CallError> {
        self.call(path, None)
    }

    /// `POST path` with a JSON body: the answer's body.
    pub fn post_json(&self, path: &str, body: &serde_json::Value) -> Result<String, CallError> {
        self.call(path, Some(body.to_string()))
    }

    fn call(&self, path: &str, body: Option<String>) -> Result<String, CallError> {
        let url = self.url(path);
        let timeout = || CallError::Timeout {
            url: url.clone(),
            seconds: self.timeout.as_secs(),
        };
        let mut backoff = BACKOFF;
        let mut attempt = 0;
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(timeout());
            }
            let result = attempt_once(&url, body.as_deref(), left);
            let retry = match &result {
                Ok(_) => false,
                Err(Failure::Status(status, _)) => *status >= 500,
                Err(Failure::Connect(_)) => true,
                Err(_) => false,
            };
            if !retry || attempt >= RETRIES {
                return result.map_err(|f| match f {
                    Failure::Timeout => timeout(),
                    Failure::Status(status, text) => CallError::Status {
                        url: url.clone(),
                        status,
                        message: error_message(&text),
                    },
                    Failure::Connect(reason) | Failure::Other(reason) => CallError::Transport {
                        url: url.clone(),
                        reason,
                    },
                });
            }
            attempt += 1;
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left <= backoff {
                return Err(timeout());
            }
            std::thread::sleep(backoff);
            backoff *= 2;
        }
    }
}

/// One attempt's failure, before it is named for the user.
enum Failure {
    Timeout,
    Status(u16, String),
    /// Not connected, or the connection dropped: worth another try.
    Connect(String),
    Other(String),
}

fn attempt_once(url: &str, body: Option<&str>, left: Duration) -> Result<String, Failure> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(left))
        .http_status_as_error(false)
        .max_redirects(0)
        .build()
        .into();
    let answer = match body {
        Some(body) => agent
            .post(url)
            .header("Content-Type", "application/json")
            .send(body),
        None => agent.get(url).call(),
    };
    let mut answer = answer.map_err(failure)?;
    let status = answer.status().as_u16();
    let text = answer
        .body_mut()
        .with_config()
        .limit(MAX_ANSWER_BYTES)
        .read_to_string()
        .map_err(failure)?;
    if status >= 400 {
        return Err(Failure::Status(status, text));
    }
    Ok(text)
}

fn failure(e: ureq::Error) -> Failure {
    match e {
        ureq::Error::Timeout(_) => Failure::Timeout,
        ureq::Error::ConnectionFailed | ureq::Error::HostNotFound => {
            Failure::Connect(e.to_string())
        }
        ureq::Error::Io(io) if io.kind() == std::io::ErrorKind::TimedOut => Failure::Timeout,
        ureq::Error::Io(io) => Failure::Connect(format!("connection: {io}")),
        ureq::Error::Protocol(p) => Failure::Other(format!("not an HTTP answer: {p}")),
        other => Failure::Other(other.to_string()),
    }
}

/// The server's own words for an error (OpenAI's `{"error": {"message"}}`, or vLLM's older
/// `{"message"}`), else the start of the body, on one line.
fn error_message(body: &str) -> String {
    let parsed: Option<serde_json::Value> = serde_json::from_str(body).ok();
    let message = parsed.as_ref().and_then(|v| {
        v.pointer("/error/message")
            .or_else(|| v.get("message"))
            .or_else(|| v.get("detail"))
            .and_then(|m| m.as_str().map(str::to_string))
    });
    let text = message.unwrap_or_else(|| body.to_string());
    let line: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match line.char_indices().nth(200) {
        Some((i, _)) => format!("{}…", &line[..i]),
        None if line.is_empty() => "(empty body)".into(),
        None => line,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_are_normalized_and_other_schemes_refused() {
        let c = Client::new("http://h:8000/v1/", Duration::from_secs(1)).unwrap();
        assert_eq!(c.url("/v1/models"), "http://h:8000/v1/models");
        assert!(matches!(
            Client::new("https://h", Duration::from_secs(1)),
            Err(CallError::Scheme { .. })
        ));
        assert!(Client::new("h:8000", Duration::from_secs(1)).is_err());
    }

    #[test]
    fn error_messages_are_the_servers_own_on_one_line() {
        assert_eq!(
            error_message(r#"{"error": {"message": "bad\n request", "code": 400}}"#),
            "bad request"
        );
        assert_eq!(
            error_message("Internal Server Error"),
            "Internal Server Error"
        );
        assert_eq!(error_message(""), "(empty body)");
    }
}

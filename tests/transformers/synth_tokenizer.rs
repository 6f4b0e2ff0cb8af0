//! The synthetic tokenizer against its other two readers: HF `tokenizers`/`transformers` must
//! encode and decode exactly as our encoder does, gguf-py must see llama.cpp's tokenizer keys.

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use glmcheck::synth::tokenizer::{SynthTokenizer, TokenKind, SPECIALS};
use glmcheck::weights::gguf::writer::GgufWriter;
use serde_json::json;

/// Texts every implementation must split the same way: ASCII, multi-byte UTF-8, whitespace
/// runs, contractions, special tokens alone, glued and malformed.
const TEXTS: &[&str] = &[
    "The capital of France is",
    "The capital of France is Paris.",
    "Hello, world! How are you today? I'm fine, thank you.",
    "",
    " ",
    "    ",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\n\n end",
    "a\r\nb",
    "Grüße 世界",
    "emoji 🙂 ñandú, naïve café",
    "\u{a0}no-break\u{a0}space and soft\u{ad}hyphen",
    "numbers 1234567890, 3.14 and 2024-06-01",
    "it's we'll they've I'd you're don't 'S 'LL",
    "Ⅻ roman numerals ⅻ",
    "नमस्ते दुनिया",
    "<|user|>Hi<|assistant|>Hello<|endoftext|>",
    "[gMASK]<sop><|system|>be brief<|observation|>",
    "<|user|<|user|> <<|endoftext|>> [gMASK",
    "The quick brown fox jumps over the lazy dog near the old stone bridge.",
];

/// A small xorshift, so generated cases need no dependency and are the same on every run.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Random strings over characters that stress pre-tokenization: letters, digits, apostrophes and
/// contraction letters, assorted whitespace, punctuation, multi-byte letters and symbols, pieces
/// of special tokens. Leaves out combining marks that std calls alphabetic (see `Class` in the
/// tokenizer): before a contraction those split differently, a documented divergence.
fn random_texts(n: usize) -> Vec<String> {
    let pool: Vec<char> = "ab Z1'sdtlmrev \n\t\r!.,-ä世Ⅻ\u{301}\u{a0}\u{2003}🙂<|>[]gMASKuser"
        .chars()
        .collect();
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    (0..n)
        .map(|_| {
            let len = rng.below(24);
            let mut s = String::new();
            for _ in 0..len {
                s.push(pool[rng.below(pool.len() as u64) as usize]);
                if rng.below(11) == 0 {
                    s.push_str(SPECIALS[rng.below(SPECIALS.len() as u64) as usize]);
                }
            }
            s
        })
        .collect()
}

fn count(tok: &SynthTokenizer, kind: TokenKind) -> usize {
    (0..tok.vocab_size() as u32)
        .filter(|&id| tok.kind(id) == Some(kind))
        .count()
}

/// Write tokenizer.json, tokenizer_config.json, a tensor-less GGUF with the tokenizer keys and
/// the expectations for `hf.tokenizer_check`.
fn write_fixture(tok: &SynthTokenizer, dir: &Path) {
    std::fs::write(dir.join("tokenizer.json"), tok.tokenizer_json()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        tok.tokenizer_config_json(),
    )
    .unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in tok.gguf_metadata() {
        w.metadata(k, v);
    }
    w.write(&dir.join("tokenizer.gguf")).unwrap();

    let texts = TEXTS.iter().map(|t| t.to_string()).chain(random_texts(500));
    let cases: Vec<_> = texts
        .map(|t| {
            let ids = tok.encode(&t);
            json!({"text": t, "ids": ids, "decoded": tok.decode(&ids)})
        })
        .collect();
    let mut rng = XorShift(7);
    let decode_cases: Vec<_> = (0..20)
        .map(|_| {
            let below = tok.vocab_size() as u64 + 3;
            let ids: Vec<u32> = (0..rng.below(40))
                .map(|_| rng.below(below) as u32)
                .collect();
            json!({"ids": ids, "text": tok.decode(&ids)})
        })
        .collect();
    let expect = json!({
        "vocab_size": tok.vocab_size(),
        "normal": count(tok, TokenKind::Normal),
        "fillers": count(tok, TokenKind::Filler),
        "specials": SPECIALS,
        "merges": tok.merges().len(),
        "eos": tok.eos_id(),
        "bos": tok.bos_id(),
        "cases": cases,
        "decode_cases": decode_cases,
    });
    std::fs::write(dir.join("expect.json"), expect.to_string()).unwrap();
}

fn check_against_python(vocab_size: usize) {
    let tok = SynthTokenizer::new(vocab_size).unwrap();
    let dir = common::scratch();
    write_fixture(&tok, dir.path());
    let out = common::run_oracle("hf.tokenizer_check", &[dir.path().to_str().unwrap()]);
    assert!(out.contains("\"ok\": true"), "{out}");
}

#[test]
fn hf_and_gguf_agree_at_300() {
    check_against_python(300);
}

#[test]
fn hf_and_gguf_agree_at_1000() {
    check_against_python(1000);
}

#[test]
fn hf_and_gguf_agree_at_glm5_size() {
    check_against_python(154_880);
}

#[test]
fn glm5_size_builds_fast() {
    let start = Instant::now();
    let tok = SynthTokenizer::new(154_880).unwrap();
    let built = start.elapsed();
    let json = tok.tokenizer_json();
    let metadata = tok.gguf_metadata();
    let all = start.elapsed();
    assert!(built < Duration::from_secs(2), "new took {built:?}");
    assert!(all < Duration::from_secs(4), "new + exports took {all:?}");
    assert!(json.len() > 1000 && metadata.len() > 5);
}

#[test]
fn vocabulary_is_deterministic_unique_and_sized() {
    for size in [263, 300, 1000, 154_880] {
        let tok = SynthTokenizer::new(size).unwrap();
        let tokens = tok.tokens();
        assert_eq!(tokens.len(), size);
        let distinct: std::collections::HashSet<_> = tokens.iter().collect();
        assert_eq!(distinct.len(), size, "duplicate token text at {size}");
        assert_eq!(&tokens[size - SPECIALS.len()..], &SPECIALS[..]);
        let again = SynthTokenizer::new(size).unwrap();
        assert_eq!(again.tokens(), tokens);
        assert_eq!(again.merges(), tok.merges());
    }
}

#[test]
fn too_small_or_too_large_is_an_error() {
    assert!(SynthTokenizer::new(262).is_err());
    assert!(SynthTokenizer::new(0).is_err());
    assert!(SynthTokenizer::new(1 << 33).is_err());
}

#[test]
fn encode_then_decode_is_identity() {
    let tok = SynthTokenizer::new(1000).unwrap();
    for text in TEXTS {
        assert_eq!(tok.decode(&tok.encode(text)), *text);
    }
}

#[test]
fn full_vocabulary_knows_the_prompt_words() {
    let tok = SynthTokenizer::new(154_880).unwrap();
    let ids = tok.encode("The capital of France is Paris.");
    let pieces: Vec<String> = ids.iter().map(|&i| tok.decode(&[i])).collect();
    assert_eq!(
        pieces,
        ["The", " capital", " of", " France", " is", " Paris", "."]
    );
    let chat = tok.encode("[gMASK]<sop><|user|>");
    assert_eq!(chat[0], tok.bos_id());
    assert_eq!(chat.len(), 3);
    assert!(chat
        .iter()
        .all(|&i| tok.kind(i) == Some(TokenKind::Special)));
}

#[test]
fn fillers_decode_to_nothing() {
    let tok = SynthTokenizer::new(2000).unwrap();
    let filler = (0..2000)
        .find(|&i| tok.kind(i) == Some(TokenKind::Filler))
        .unwrap();
    assert_eq!(tok.decode(&[filler]), "");
    assert_eq!(tok.decode(&[2000, 70_000]), "");
}

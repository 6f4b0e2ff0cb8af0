//! A real byte-level BPE tokenizer for synthetic GLM-5 models, so `--prompt "…"` works on them.
//!
//! One deterministic vocabulary, three consumers that must agree id for id: our own
//! [`SynthTokenizer::encode`], Hugging Face `tokenizers` (through [`SynthTokenizer::tokenizer_json`])
//! and llama.cpp (through [`SynthTokenizer::gguf_metadata`]). All three pre-tokenize with GPT-2's
//! pattern (`tokenizer.ggml.pre = "gpt-2"`, HF's `ByteLevel` with `use_regex`), not GLM's `glm4`
//! pattern: GPT-2's is the one HF's ByteLevel pre-tokenizer carries built in, so the tokenizer.json
//! needs no hand-written regex that could drift from ours.
//!
//! Vocabulary layout: ids 0–255 are the bytes (id = byte value), then merges learned from
//! `CORPUS`, then unused fillers up to the requested size, then GLM's special tokens at the end.

use std::collections::HashMap;

use serde_json::json;

use crate::weights::gguf::{Value, ValueType};

/// GLM's special tokens, in GLM's relative order; they take the last ids of the vocabulary.
/// The `*_AT` constants index into it.
pub const SPECIALS: [&str; 7] = [
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
];

const ENDOFTEXT_AT: usize = 0;
const GMASK_AT: usize = 1;
const USER_AT: usize = 4;
const OBSERVATION_AT: usize = 6;

/// gguf-py's `TokenType` values we use.
const TYPE_NORMAL: i32 = 1;
const TYPE_CONTROL: i32 = 3;
const TYPE_UNUSED: i32 = 5;

/// The English text merges are learned from: ASCII only, so every learned token is ASCII and
/// non-ASCII bytes always stay single-byte tokens (why that matters: see [`Class`]).
const CORPUS: &str = "\
The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.
The capital of Spain is Madrid. The capital of Japan is Tokyo. The capital of Canada is Ottawa.
The capital of Egypt is Cairo. The capital of Kenya is Nairobi. The capital of Peru is Lima.
The capital of Norway is Oslo. The capital of Greece is Athens. The capital of Chile is Santiago.
Paris is a large city on the river Seine, and it's known for its museums and its bridges.
Berlin was divided for many years; today it is one city again.
Which city is the capital of Australia? It is Canberra, not Sydney.
One, two, three, four, five, six, seven, eight, nine, ten.
The numbers 1, 2, 3, 10, 42, 100, 256 and 2024 are written with digits.
Two plus two is four. Three times three is nine. Ten minus seven is three.
A year has 365 days, a week has 7 days, and a day has 24 hours.
The model reads a prompt and predicts the next token, one token at a time.
If the weights are wrong, the answer is wrong: the model may print garbage.
We don't know why it failed yet, but we'll find out when we compare the layers.
She said that the test passed; he said that it didn't.
The quick brown fox jumps over the lazy dog near the old stone bridge.
In the morning the market is busy, and in the evening the streets are quiet.
Water boils at 100 degrees and freezes at 0 degrees on the Celsius scale.
The sun is a star, the moon is not a planet, and the earth is round.
Hello, world! How are you today? I'm fine, thank you.
";

/// Two adjacent token ids, as a merge takes them.
type Pair = (u32, u32);

/// What a vocabulary id stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenKind {
    /// A byte or a learned merge: reachable by encoding.
    Normal,
    /// Padding up to the requested size: never produced by encoding, decodes to nothing.
    Filler,
    /// One of [`SPECIALS`]: matched verbatim in text before pre-tokenization.
    Special,
}

/// A deterministic byte-level BPE vocabulary of an exact size, with its encoder and decoder.
#[derive(Clone, Debug)]
pub struct SynthTokenizer {
    /// Raw bytes of every normal token; index = id.
    pieces: Vec<Vec<u8>>,
    /// Merges in rank order, as (left id, right id).
    merges: Vec<Pair>,
    /// Pair → (rank, id of the merged token).
    ranks: HashMap<Pair, (usize, u32)>,
    vocab_size: usize,
}

impl SynthTokenizer {
    /// Build the vocabulary of exactly `vocab_size` ids (at least the 256 bytes plus the specials).
    pub fn new(vocab_size: usize) -> Result<Self, String> {
        let min = 256 + SPECIALS.len();
        if vocab_size < min || u32::try_from(vocab_size).is_err() {
            return Err(format!(
                "tokenizer vocabulary of {vocab_size} ids: need between {min} and {}",
                u32::MAX
            ));
        }
        let (pieces, learned) = learn(vocab_size - SPECIALS.len());
        let ranks = learned
            .iter()
            .enumerate()
            .map(|(rank, &(pair, id))| (pair, (rank, id)))
            .collect();
        Ok(Self {
            pieces,
            merges: learned.into_iter().map(|(pair, _)| pair).collect(),
            ranks,
            vocab_size,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Ids below this are normal tokens (bytes and merges).
    fn n_normal(&self) -> usize {
        self.pieces.len()
    }

    /// Id of the first special token; the specials run to the end of the vocabulary.
    fn special_base(&self) -> usize {
        self.vocab_size - SPECIALS.len()
    }

    pub fn kind(&self, id: u32) -> Option<TokenKind> {
        let id = id as usize;
        match id {
            _ if id < self.n_normal() => Some(TokenKind::Normal),
            _ if id < self.special_base() => Some(TokenKind::Filler),
            _ if id < self.vocab_size => Some(TokenKind::Special),
            _ => None,
        }
    }

    /// Id of a special token by its text (one of [`SPECIALS`]).
    pub fn special_id(&self, text: &str) -> Option<u32> {
        let k = SPECIALS.iter().position(|&s| s == text)?;
        Some(self.special_at(k))
    }

    fn special_at(&self, k: usize) -> u32 {
        (self.special_base() + k) as u32
    }

    /// End of sequence (and padding, unknown): `<|endoftext|>`, as GLM.
    pub fn eos_id(&self) -> u32 {
        self.special_at(ENDOFTEXT_AT)
    }

    /// GLM's converter calls `[gMASK]` the bos token (its chat template starts with it); nothing
    /// prepends it automatically.
    pub fn bos_id(&self) -> u32 {
        self.special_at(GMASK_AT)
    }

    /// Every token's text in id order: byte-level strings for normal tokens (GPT-2's printable
    /// remapping, `Ġ` for space), `<|filler_N|>` for fillers, the specials verbatim.
    pub fn tokens(&self) -> Vec<String> {
        let normal = self.pieces.iter().map(|p| byte_level(p));
        let fillers = (0..self.special_base() - self.n_normal()).map(|n| format!("<|filler_{n}|>"));
        let specials = SPECIALS.iter().map(|s| s.to_string());
        normal.chain(fillers).chain(specials).collect()
    }

    /// Merges in rank order as byte-level `(left, right)` strings.
    pub fn merges(&self) -> Vec<(String, String)> {
        self.merges
            .iter()
            .map(|&(a, b)| {
                (
                    byte_level(&self.pieces[a as usize]),
                    byte_level(&self.pieces[b as usize]),
                )
            })
            .collect()
    }

    /// Merges as the `"left right"` lines both llama.cpp and tokenizer.json take (byte-level
    /// strings never hold a plain space, so the split is unambiguous).
    fn merge_lines(&self) -> Vec<String> {
        self.merges()
            .into_iter()
            .map(|(a, b)| format!("{a} {b}"))
            .collect()
    }

    /// The built-in corpus as ids: what synthetic models learn their next-token pattern from.
    pub fn corpus_ids(&self) -> Vec<u32> {
        self.encode(CORPUS)
    }

    /// Text to ids: specials matched verbatim (leftmost, then longest), the rest pre-tokenized
    /// GPT-2 style and BPE-merged by rank. Adds no bos/eos.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut rest = text;
        while let Some((at, k)) = next_special(rest) {
            self.encode_plain(&rest[..at], &mut out);
            out.push(self.special_at(k));
            rest = &rest[at + SPECIALS[k].len()..];
        }
        self.encode_plain(rest, &mut out);
        out
    }

    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        for word in pre_tokenize(text) {
            out.extend(self.bpe(word));
        }
    }

    /// Standard BPE: repeatedly merge the adjacent pair of lowest rank, leftmost on ties.
    fn bpe(&self, word: &str) -> Vec<u32> {
        let mut symbols: Vec<u32> = word.bytes().map(u32::from).collect();
        while let Some((at, id)) = self.best_merge(&symbols) {
            symbols[at] = id;
            symbols.remove(at + 1);
        }
        symbols
    }

    fn best_merge(&self, symbols: &[u32]) -> Option<(usize, u32)> {
        symbols
            .windows(2)
            .enumerate()
            .filter_map(|(at, w)| {
                let &(rank, id) = self.ranks.get(&(w[0], w[1]))?;
                Some((rank, at, id))
            })
            .min()
            .map(|(_, at, id)| (at, id))
    }

    /// Ids to text: bytes of normal tokens, specials verbatim, fillers and unknown ids dropped
    /// (as HF drops ids its tokenizer.json lacks); invalid UTF-8 becomes U+FFFD, as in HF.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            match self.kind(id) {
                Some(TokenKind::Normal) => bytes.extend_from_slice(&self.pieces[id as usize]),
                Some(TokenKind::Special) => {
                    bytes.extend_from_slice(SPECIALS[id as usize - self.special_base()].as_bytes())
                }
                Some(TokenKind::Filler) | None => {}
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The `tokenizer.*` keys llama.cpp reads, with GLM's choice of special ids.
    pub fn gguf_metadata(&self) -> Vec<(String, Value)> {
        let strings = |v: Vec<String>| {
            Value::Array(
                ValueType::String,
                v.into_iter().map(Value::String).collect(),
            )
        };
        let types = (0..self.vocab_size as u32)
            .map(|id| {
                Value::I32(match self.kind(id) {
                    Some(TokenKind::Filler) => TYPE_UNUSED,
                    Some(TokenKind::Special) => TYPE_CONTROL,
                    _ => TYPE_NORMAL,
                })
            })
            .collect();
        let entries = [
            ("model", Value::String("gpt2".into())),
            ("pre", Value::String("gpt-2".into())),
            ("tokens", strings(self.tokens())),
            ("token_type", Value::Array(ValueType::I32, types)),
            ("merges", strings(self.merge_lines())),
            ("bos_token_id", Value::U32(self.bos_id())),
            ("eos_token_id", Value::U32(self.eos_id())),
            ("eot_token_id", Value::U32(self.special_at(USER_AT))),
            ("eom_token_id", Value::U32(self.special_at(OBSERVATION_AT))),
            ("unknown_token_id", Value::U32(self.eos_id())),
            ("padding_token_id", Value::U32(self.eos_id())),
            ("add_bos_token", Value::Bool(false)),
        ];
        entries
            .into_iter()
            .map(|(k, v)| (format!("tokenizer.ggml.{k}"), v))
            .collect()
    }

    /// A `tokenizer.json` for HF `tokenizers`: byte-level BPE over the normal tokens, the specials
    /// as added tokens. Fillers are left out, like the unused tail of GLM's own padded vocabulary.
    /// The specials sit in the BPE vocabulary too: `tokenizers` keeps an added token's id only
    /// when the model knows it, and renumbers it after the model's last id otherwise.
    pub fn tokenizer_json(&self) -> String {
        let vocab: serde_json::Map<String, serde_json::Value> = self
            .tokens()
            .into_iter()
            .zip(0u32..)
            .filter(|&(_, id)| self.kind(id) != Some(TokenKind::Filler))
            .map(|(text, id)| (text, json!(id)))
            .collect();
        let added: Vec<_> = SPECIALS
            .iter()
            .enumerate()
            .map(|(k, s)| {
                json!({
                    "id": self.special_base() + k, "content": s, "single_word": false,
                    "lstrip": false, "rstrip": false, "normalized": false, "special": true,
                })
            })
            .collect();
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": byte_level,
            "post_processor": null,
            "decoder": byte_level,
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": self.merge_lines(),
            },
        })
        .to_string()
    }

    /// A `tokenizer_config.json` so `AutoTokenizer.from_pretrained` picks the fast tokenizer;
    /// no space clean-up on decode, which would break decode(encode(x)) == x.
    pub fn tokenizer_config_json(&self) -> String {
        json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": SPECIALS[0],
            "pad_token": SPECIALS[0],
            "clean_up_tokenization_spaces": false,
        })
        .to_string()
    }
}

/// Learn merges from [`CORPUS`] until there are `n_normal` normal tokens or no pair is left.
/// Ties go to the smallest pair of ids, so the result is the same on every run. Returns the
/// tokens' bytes and the merges in rank order with the id each produces (two merges may produce
/// the same bytes, hence the same id).
fn learn(n_normal: usize) -> (Vec<Vec<u8>>, Vec<(Pair, u32)>) {
    let mut pieces: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    let mut index: HashMap<Vec<u8>, u32> = pieces
        .iter()
        .enumerate()
        .map(|(i, p)| (p.clone(), i as u32))
        .collect();
    let mut words = corpus_words();
    let mut merges = Vec::new();
    while pieces.len() < n_normal {
        let Some(pair) = most_frequent_pair(&words) else {
            break;
        };
        let joined = [&pieces[pair.0 as usize][..], &pieces[pair.1 as usize][..]].concat();
        let id = match index.get(&joined) {
            Some(&id) => id,
            None => {
                let id = pieces.len() as u32;
                index.insert(joined.clone(), id);
                pieces.push(joined);
                id
            }
        };
        merges.push((pair, id));
        for (word, _) in &mut words {
            merge_pair(word, pair, id);
        }
    }
    (pieces, merges)
}

/// The corpus's distinct pre-tokens as byte ids, with their counts.
fn corpus_words() -> Vec<(Vec<u32>, u64)> {
    let mut counts: HashMap<&str, u64> = HashMap::new();
    for word in pre_tokenize(CORPUS) {
        *counts.entry(word).or_default() += 1;
    }
    counts
        .into_iter()
        .map(|(w, n)| (w.bytes().map(u32::from).collect(), n))
        .collect()
}

fn most_frequent_pair(words: &[(Vec<u32>, u64)]) -> Option<Pair> {
    let mut counts: HashMap<Pair, u64> = HashMap::new();
    for (word, n) in words {
        for w in word.windows(2) {
            *counts.entry((w[0], w[1])).or_default() += n;
        }
    }
    counts
        .into_iter()
        .max_by_key(|&(pair, n)| (n, std::cmp::Reverse(pair)))
        .map(|(pair, _)| pair)
}

/// Replace every non-overlapping occurrence of `pair` in `word`, left to right.
fn merge_pair(word: &mut Vec<u32>, pair: Pair, id: u32) {
    let mut out = Vec::with_capacity(word.len());
    let mut i = 0;
    while i < word.len() {
        if i + 1 < word.len() && (word[i], word[i + 1]) == pair {
            out.push(id);
            i += 2;
        } else {
            out.push(word[i]);
            i += 1;
        }
    }
    *word = out;
}

/// Leftmost occurrence of a special token in `text`, the longest one on ties: (byte offset,
/// index into [`SPECIALS`]).
fn next_special(text: &str) -> Option<(usize, usize)> {
    text.char_indices().find_map(|(at, _)| {
        let tail = &text[at..];
        SPECIALS
            .iter()
            .enumerate()
            .filter(|(_, s)| tail.starts_with(*s))
            .max_by_key(|(_, s)| s.len())
            .map(|(k, _)| (at, k))
    })
}

/// GPT-2's printable stand-in for a byte: printable Latin-1 bytes stand for themselves, the other
/// 68 (controls, space, DEL, NBSP, soft hyphen) take U+0100 onwards in byte order.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(0x100 + rank).unwrap_or(char::REPLACEMENT_CHARACTER)
}

fn byte_level(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| byte_char(b)).collect()
}

/// Character classes of GPT-2's pattern: `\s`, `\p{L}`, `\p{N}`, everything else.
///
/// std has no general-category lookup, so letters are "alphabetic and not numeric": that adds the
/// Other_Alphabetic combining marks (e.g. Devanagari vowel signs) and circled letters to `\p{L}`.
/// Since every merge is ASCII, a non-ASCII character's class only matters when it is directly
/// followed by a contraction such as `'s` (HF and llama.cpp then glue the apostrophe to it).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Space,
    Letter,
    Number,
    Other,
}

fn class(c: char) -> Class {
    if c.is_whitespace() {
        Class::Space
    } else if c.is_numeric() {
        Class::Number
    } else if c.is_alphabetic() {
        Class::Letter
    } else {
        Class::Other
    }
}

/// GPT-2's contractions, case-sensitive as in its pattern.
const CONTRACTIONS: [&str; 7] = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"];

/// Split text as GPT-2's pattern
/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+` does.
fn pre_tokenize(text: &str) -> Vec<&str> {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let offset = |i: usize| chars.get(i).map_or(text.len(), |&(at, _)| at);
    let mut words = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let end = word_end(text, &chars, i);
        words.push(&text[offset(i)..offset(end)]);
        i = end;
    }
    words
}

/// Char index where the pre-token starting at char `i` ends, trying the alternatives in order.
fn word_end(text: &str, chars: &[(usize, char)], i: usize) -> usize {
    let tail = &text[chars[i].0..];
    if let Some(c) = CONTRACTIONS.iter().find(|c| tail.starts_with(*c)) {
        return i + c.len();
    }
    let next_is_word = chars
        .get(i + 1)
        .is_some_and(|&(_, c)| class(c) != Class::Space);
    let start = i + usize::from(chars[i].1 == ' ' && next_is_word);
    let kind = class(chars[start].1);
    let run = |from: usize, k: Class| {
        from + chars[from..]
            .iter()
            .take_while(|&&(_, c)| class(c) == k)
            .count()
    };
    if kind != Class::Space {
        return run(start, kind);
    }
    // `\s+(?!\S)`: before a word, leave the last whitespace char to that word's pre-token.
    let end = run(i, Class::Space);
    if end < chars.len() && end - i > 1 {
        end - 1
    } else {
        end
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pre_tokenize_follows_gpt2() {
        let cases: [(&str, &[&str]); 6] = [
            ("Hello world", &["Hello", " world"]),
            ("it's 2024!!", &["it", "'s", " 2024", "!!"]),
            ("a   b", &["a", "  ", " b"]),
            ("a\n\nb  ", &["a", "\n", "\n", "b", "  "]),
            (" 's", &[" '", "s"]),
            ("x\tb", &["x", "\t", "b"]),
        ];
        for (text, want) in cases {
            assert_eq!(pre_tokenize(text), want, "{text:?}");
        }
    }

    #[test]
    fn byte_chars_are_gpt2s() {
        assert_eq!(byte_char(b' '), 'Ġ');
        assert_eq!(byte_char(b'\n'), 'Ċ');
        assert_eq!(byte_char(b'A'), 'A');
        assert_eq!(byte_char(0xAD), '\u{143}');
        let all: std::collections::HashSet<char> = (0..=255u8).map(byte_char).collect();
        assert_eq!(all.len(), 256);
    }
}

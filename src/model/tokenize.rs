//! Text to token ids and back for `--prompt`: the `tokenizer.json` of a Hugging Face folder, or
//! the byte-level BPE a GGUF carries in `tokenizer.ggml.*`, both through the `tokenizers` crate.

use anyhow::{bail, Context, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::weights::gguf::{GgufModel, Value};
use crate::weights::ModelFiles;

/// llama3's pre-tokenizer pattern, which llama.cpp also applies for `tokenizer.ggml.pre = glm4`.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// gguf-py's token type of control (special) tokens.
const CONTROL: i64 = 3;

/// The model's tokenizer.
pub fn load(files: &ModelFiles) -> Result<Tokenizer> {
    if let Some(gguf) = files.gguf() {
        return from_gguf(gguf).with_context(|| files.path.display().to_string());
    }
    let config = files
        .hf_config_path()
        .context("no config.json beside the weights")?;
    let path = config.with_file_name("tokenizer.json");
    Tokenizer::from_file(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

fn strings<'a>(gguf: &'a GgufModel, key: &str) -> Result<Vec<&'a str>> {
    let items = gguf
        .get(key)
        .and_then(Value::as_array)
        .with_context(|| format!("metadata `{key}` missing"))?;
    items
        .iter()
        .map(|v| {
            v.as_str()
                .with_context(|| format!("metadata `{key}`: {v} is not a string"))
        })
        .collect()
}

/// A `gpt2`-model GGUF tokenizer: byte-level BPE over `tokens` and `merges`, control tokens
/// matched whole.
fn from_gguf(gguf: &GgufModel) -> Result<Tokenizer> {
    let model = gguf
        .get("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .unwrap_or("");
    if model != "gpt2" {
        bail!("tokenizer.ggml.model `{model}`: only byte-level BPE (`gpt2`, as GLM-5 uses) is supported");
    }
    let tokens = strings(gguf, "tokenizer.ggml.tokens")?;
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let merges = strings(gguf, "tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .with_context(|| format!("merge `{m}` is not `A B`"))
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| anyhow::anyhow!("BPE: {e}"))?;
    let mut tok = Tokenizer::new(bpe);
    match gguf
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("gpt-2")
    {
        "gpt-2" | "default" => {
            tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        }
        "glm4" | "llama-bpe" | "llama3" => {
            let split = Split::new(
                SplitPattern::Regex(LLAMA3_PATTERN.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| anyhow::anyhow!("pre-tokenizer: {e}"))?;
            tok.with_pre_tokenizer(Some(Sequence::new(vec![
                split.into(),
                ByteLevel::new(false, true, false).into(),
            ])));
        }
        other => bail!("tokenizer.ggml.pre `{other}` is not supported (gpt-2, glm4, llama3 are)"),
    }
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    let types = gguf
        .get("tokenizer.ggml.token_type")
        .and_then(Value::as_array)
        .unwrap_or(&[]);
    let specials: Vec<AddedToken> = types
        .iter()
        .zip(&tokens)
        .filter(|(ty, _)| ty.as_f64() == Some(CONTROL as f64))
        .map(|(_, t)| AddedToken::from(t.to_string(), true))
        .collect();
    tok.add_special_tokens(specials)
        .map_err(|e| anyhow::anyhow!("special tokens: {e}"))?;
    Ok(tok)
}

/// Ids of `text` (no special tokens added).
pub fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    Ok(tok
        .encode(text, false)
        .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?
        .get_ids()
        .to_vec())
}

pub fn decode(tok: &Tokenizer, ids: &[u32]) -> Result<String> {
    tok.decode(ids, false)
        .map_err(|e| anyhow::anyhow!("decoding: {e}"))
}

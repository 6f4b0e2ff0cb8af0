//! Every GGUF key llama.cpp's loaders read for the family is accounted for by bisect: compared
//! with the reference's config (`KEYS`) or listed with what becomes of it (`OTHER_KEYS`). The
//! keys are read from llama.cpp's own source in the tree the tests build — its generic
//! hyperparameter loading, the glm-dsa, deepseek2 and deepseek32 loaders and the key-name table —
//! so a key a new llama.cpp reads fails this test until bisect says what it does with it.

use crate::common;

use std::collections::BTreeSet;
use std::path::PathBuf;

use glmcheck::diagnose::settings::{KEYS, OTHER_KEYS};

/// llama.cpp's source, as scripts/setup-llamacpp unpacks it.
fn source() -> PathBuf {
    let dir = common::root().join(".oracles/llama.cpp/src/src");
    assert!(
        dir.join("models/glm-dsa.cpp").exists(),
        "llama.cpp's source is not unpacked: run scripts/setup-llamacpp (scripts/test does)"
    );
    dir
}

fn read(path: PathBuf) -> String {
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The `LLM_KV_*` names in `text`, in order.
fn kv_names(text: &str) -> Vec<String> {
    text.match_indices("LLM_KV_")
        .map(|(at, _)| {
            text[at..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect()
        })
        .collect()
}

/// The body of the function whose definition starts with `head`: up to the first line that is
/// a lone `}` in the first column.
fn body<'a>(text: &'a str, head: &str) -> &'a str {
    let start = text
        .find(head)
        .unwrap_or_else(|| panic!("no `{head}` in llama.cpp's source"));
    let end = text[start..]
        .find("\n}\n")
        .unwrap_or_else(|| panic!("`{head}` has no end"));
    &text[start..start + end]
}

/// The key string of each `LLM_KV_*` name (`%s.` dropped: the arch prefix), from the table in
/// llama-arch.cpp: `{ LLM_KV_NAME, "key" },`.
fn key_strings(arch_cpp: &str) -> Vec<(String, String)> {
    arch_cpp
        .lines()
        .filter_map(|line| {
            let line = line.trim().strip_prefix("{ LLM_KV_")?;
            let (name, rest) = line.split_once(',')?;
            let key = rest.trim().strip_prefix('"')?.split('"').next()?;
            Some((
                format!("LLM_KV_{}", name.trim()),
                key.trim_start_matches("%s.").to_string(),
            ))
        })
        .collect()
}

#[test]
fn every_key_llama_cpp_reads_for_the_family_is_compared_or_accounted_for() {
    let src = source();
    let model = read(src.join("llama-model.cpp"));
    let table = key_strings(&read(src.join("llama-arch.cpp")));
    assert!(
        table.len() > 100,
        "llama-arch.cpp's key table: {}",
        table.len()
    );

    let mut read_names = kv_names(body(
        &model,
        "void llama_model_base::load_hparams(llama_model_loader & ml)",
    ));
    for arch in ["glm_dsa", "deepseek2", "deepseek32"] {
        let file = read(src.join(format!("models/{}.cpp", arch.replace('_', "-"))));
        read_names.extend(kv_names(body(
            &file,
            &format!("void llama_model_{arch}::load_arch_hparams("),
        )));
    }
    let read_keys: BTreeSet<String> = read_names
        .iter()
        .map(|name| {
            table
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, k)| k.clone())
                .unwrap_or_else(|| panic!("{name} is not in llama-arch.cpp's key table"))
        })
        .collect();
    assert!(
        read_keys.contains("rope.freq_base") && read_keys.contains("attention.indexer.top_k"),
        "the loaders' keys: {read_keys:?}"
    );

    let compared = KEYS.iter().filter_map(|k| k.key);
    let accounted: BTreeSet<String> = compared
        .chain(OTHER_KEYS.iter().map(|(k, _)| *k))
        .map(str::to_string)
        .collect();
    let unaccounted: Vec<&String> = read_keys.difference(&accounted).collect();
    let stale: Vec<&String> = accounted.difference(&read_keys).collect();
    assert!(
        unaccounted.is_empty(),
        "keys llama.cpp reads for the family that bisect neither compares nor accounts for: \
         {unaccounted:?}"
    );
    assert!(
        stale.is_empty(),
        "keys bisect lists that llama.cpp's loaders no longer read: {stale:?}"
    );
    // Each key has one place.
    let compared: BTreeSet<&str> = KEYS.iter().filter_map(|k| k.key).collect();
    let other: BTreeSet<&str> = OTHER_KEYS.iter().map(|(k, _)| *k).collect();
    assert!(
        compared.is_disjoint(&other),
        "{:?}",
        compared.intersection(&other)
    );
}

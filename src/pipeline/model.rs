//! A checkpoint opened once per pipeline: its files, GLM-5 config and family, shared by every
//! run and check that reads it (opening a split GGUF set or a safetensors index maps and parses
//! every file, which a bisect would otherwise repeat for each of its runs).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};

use crate::exec::source::WeightSource;
use crate::model::config::{GGUF_ARCHS, HF_MODEL_TYPES};
use crate::model::schema::Family;
use crate::model::Glm5Config;
use crate::weights::ModelFiles;

/// One opened GLM-5 checkpoint. Cloning shares the mapped files.
#[derive(Clone)]
pub struct Model {
    pub files: Arc<ModelFiles>,
    pub cfg: Glm5Config,
    pub family: Family,
}

impl Model {
    /// Open `path` (a `.gguf`, a safetensors file, index or folder), or an input error naming
    /// the file.
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        let files = ModelFiles::open(path)?;
        let Some((cfg, family)) = glm5_config(&files)? else {
            bail!(
                "{}: not a checkpoint of the MLA/MoE family (GGUF architecture none of {}, config.json model_type none of {})",
                path.display(),
                GGUF_ARCHS.join(", "),
                HF_MODEL_TYPES.join(", ")
            );
        };
        Ok(Model {
            files: Arc::new(files),
            cfg,
            family,
        })
    }

    /// What the user named.
    pub fn path(&self) -> &Path {
        &self.files.path
    }

    /// The same path, owned (for reports).
    pub fn path_buf(&self) -> PathBuf {
        self.files.path.clone()
    }

    /// These weights as a trace names the model it ran: path and fingerprint, no config (for a
    /// trace made from another tool's files, such as an SGLang dump of these weights).
    pub fn run_info(&self) -> crate::trace::ModelInfo {
        crate::trace::ModelInfo {
            source: self.path().display().to_string(),
            fingerprint: super::record::fingerprint(&self.files),
            ..Default::default()
        }
    }

    /// A weight source over these files.
    pub fn source(&self) -> WeightSource {
        WeightSource::new(self.files.clone(), self.cfg.clone(), self.family)
    }
}

/// The checkpoint's config, if it is a checkpoint of the family.
pub fn glm5_config(files: &ModelFiles) -> anyhow::Result<Option<(Glm5Config, Family)>> {
    if let Some(g) = files.gguf() {
        if !g.architecture().is_some_and(|a| GGUF_ARCHS.contains(&a)) {
            return Ok(None);
        }
        let cfg = Glm5Config::from_gguf(g).with_context(|| files.path.display().to_string())?;
        return Ok(Some((cfg, Family::Gguf)));
    }
    let Some(path) = files.hf_config_path() else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let is_glm5 = serde_json::from_str::<serde_json::Value>(&text)
        .map(|j| {
            j.get("model_type")
                .and_then(|m| m.as_str())
                .is_some_and(|m| HF_MODEL_TYPES.contains(&m))
        })
        .unwrap_or(false);
    if !is_glm5 {
        return Ok(None);
    }
    let cfg = Glm5Config::from_hf_json(&text).with_context(|| path.display().to_string())?;
    Ok(Some((cfg, Family::Hf)))
}

//! Stage names (docs/design.md §4): `embed`, `L{n}.{kind}`, `final_norm`, `logits`. Every module
//! builds and reads them through [`Stage`], so they all agree on one spelling.
//!
//! A layer's kind is kept as written: engines record kinds this build does not (extras named
//! `L{n}.<part>.<what>`), and those must survive a round trip. A TP rank's part is no suffix of
//! the name: traces carry the rank beside it.

use std::fmt;

/// Where in the forward a stage is: before, in or after the layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Place {
    Embed,
    Layer(u64),
    FinalNorm,
    Logits,
}

impl Place {
    pub fn layer(self) -> Option<u64> {
        match self {
            Place::Layer(l) => Some(l),
            _ => None,
        }
    }
}

/// `embed`, `L{n}` (the label a layer's stages are grouped under), `final_norm`, `logits`.
impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Place::Embed => f.write_str("embed"),
            Place::Layer(l) => write!(f, "L{l}"),
            Place::FinalNorm => f.write_str("final_norm"),
            Place::Logits => f.write_str("logits"),
        }
    }
}

/// A stage name, parsed; `Display` writes it back exactly.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Stage {
    place: Place,
    /// The name after `L{n}.` in a layer, empty outside the layers.
    kind: String,
}

impl Stage {
    /// Stage `kind` (such as `attn.q_a`) of layer `layer`.
    pub fn layer_stage(layer: u64, kind: &str) -> Stage {
        Stage {
            place: Place::Layer(layer),
            kind: kind.to_string(),
        }
    }

    /// The residual stream layer `layer` reads: `embed`, or the previous layer's `out`.
    pub fn layer_input(layer: u64) -> Stage {
        match layer {
            0 => Stage {
                place: Place::Embed,
                kind: String::new(),
            },
            l => Stage::layer_stage(l - 1, "out"),
        }
    }

    /// `None` for a name that is no stage: another top-level name, or a malformed `L` prefix.
    pub fn parse(name: &str) -> Option<Stage> {
        let (place, kind) = split(name)?;
        Some(Stage {
            place,
            kind: kind.to_string(),
        })
    }

    pub fn place(&self) -> Place {
        self.place
    }

    pub fn layer(&self) -> Option<u64> {
        self.place.layer()
    }

    /// The name after `L{n}.`; empty outside the layers.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// Stage `kind` of the same layer (`None` outside the layers).
    pub fn sibling(&self, kind: &str) -> Option<Stage> {
        Some(Stage::layer_stage(self.layer()?, kind))
    }

    /// The stage recording the score gaps at the boundary of this top-k choice, which tell a
    /// near tie from a real change; `None` for other stages.
    pub fn gaps(&self) -> Option<Stage> {
        match self.kind() {
            "attn.index_topk" => self.sibling("attn.index_gap"),
            "moe.topk_ids" => self.sibling("moe.topk_gap"),
            _ => None,
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.place {
            Place::Layer(_) => write!(f, "{}.{}", self.place, self.kind),
            _ => write!(f, "{}", self.place),
        }
    }
}

/// The layer of stage `name`; `None` outside the layers or for a name that is no stage.
pub fn layer_of(name: &str) -> Option<u64> {
    split(name)?.0.layer()
}

/// The kind of stage `name`, borrowed from it (`L12.moe.routed` → `moe.routed`); `None` outside
/// the layers or for a name that is no stage.
pub fn kind_of(name: &str) -> Option<&str> {
    match split(name)? {
        (Place::Layer(_), kind) => Some(kind),
        _ => None,
    }
}

/// Whether stage `name` holds top-k boundary gaps (`…_gap`, see [`Stage::gaps`]): evidence about
/// near ties, not an output to judge.
pub fn is_gaps(name: &str) -> bool {
    name.ends_with("_gap")
}

/// A name's place and kind (empty outside the layers), without copying the kind.
fn split(name: &str) -> Option<(Place, &str)> {
    let place = match name {
        "embed" => Place::Embed,
        "final_norm" => Place::FinalNorm,
        "logits" => Place::Logits,
        _ => {
            let (layer, kind) = name.strip_prefix('L')?.split_once('.')?;
            let layer = canonical_decimal(layer)?;
            return (!kind.is_empty()).then_some((Place::Layer(layer), kind));
        }
    };
    Some((place, ""))
}

/// Digits without a sign or leading zeros, the only spelling `Display` writes back.
fn canonical_decimal(s: &str) -> Option<u64> {
    let digits = !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let leading_zero = s.len() > 1 && s.starts_with('0');
    if !digits || leading_zero {
        return None;
    }
    s.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::stages::stage_names;
    use crate::synth::preset::Preset;

    #[test]
    fn every_catalogued_name_round_trips() {
        let names = stage_names(&Preset::Tiny.config());
        for name in &names {
            let stage = Stage::parse(name).unwrap_or_else(|| panic!("{name} does not parse"));
            assert_eq!(stage.to_string(), *name);
        }
        let moe = Stage::parse("L2.moe.topk_ids").unwrap();
        assert_eq!(moe.place(), Place::Layer(2));
        assert_eq!(moe.kind(), "moe.topk_ids");
        assert_eq!(moe, Stage::layer_stage(2, "moe.topk_ids"));
        assert_eq!(Stage::parse("embed").unwrap().layer(), None);
        assert_eq!(Stage::parse("logits").unwrap().kind(), "");
    }

    #[test]
    fn unknown_kinds_round_trip() {
        for name in ["L7.attn.index_gap", "L12.some_engine.extra", "L0.x"] {
            assert_eq!(Stage::parse(name).unwrap().to_string(), name);
        }
        assert_eq!(kind_of("L12.moe.routed"), Some("moe.routed"));
        assert_eq!(layer_of("L12.moe.routed"), Some(12));
    }

    #[test]
    fn malformed_names_are_no_stages() {
        for name in [
            "", "L", "L.", "Lx.attn", "L3", "L3.", "L-1.out", "L+1.out", "L03.out", "l3.out",
            "tokens", "logits.x",
        ] {
            assert_eq!(Stage::parse(name), None, "{name:?}");
            assert_eq!(layer_of(name), None, "{name:?}");
            assert_eq!(kind_of(name), None, "{name:?}");
        }
    }

    #[test]
    fn layer_inputs_and_gaps() {
        assert_eq!(Stage::layer_input(0).to_string(), "embed");
        assert_eq!(Stage::layer_input(3).to_string(), "L2.out");
        let gaps = |name: &str| Stage::parse(name).unwrap().gaps().map(|s| s.to_string());
        assert_eq!(gaps("L1.moe.topk_ids").as_deref(), Some("L1.moe.topk_gap"));
        assert_eq!(
            gaps("L0.attn.index_topk").as_deref(),
            Some("L0.attn.index_gap")
        );
        assert_eq!(gaps("L1.moe.topk_weights"), None);
        assert_eq!(gaps("logits"), None);
        assert!(is_gaps("L1.moe.topk_gap") && !is_gaps("L1.moe.topk_ids"));
    }
}

//! Planted faults: the catalogue (`inject`) and the hooks through which a planted fault changes
//! a run (`hooks`). A new fault class is an entry in the catalogue and, where it needs one, a
//! hook at the point of the forward it reaches.

pub mod hooks;
pub mod inject;

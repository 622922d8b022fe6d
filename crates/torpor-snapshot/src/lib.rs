//! torpor-snapshot

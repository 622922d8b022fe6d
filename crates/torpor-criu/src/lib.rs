//! torpor-criu

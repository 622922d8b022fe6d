//! torpor-image

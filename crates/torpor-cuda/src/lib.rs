//! torpor-cuda

//! transformer (in progress)

//! weights (in progress)

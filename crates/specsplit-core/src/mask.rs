//! mask (in progress)

//! loader (in progress)

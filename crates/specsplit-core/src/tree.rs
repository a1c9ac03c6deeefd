//! tree (in progress)

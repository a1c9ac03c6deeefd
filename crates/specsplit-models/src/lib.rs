//! specsplit-models

//! Without `cuda` nothing applies: [`super::applies`] is false, so these are unreachable
//! through the public functions, which check it first.
use super::AttnShape;
use candle_core::{Error, Result, Tensor};

fn off() -> Error {
    Error::Msg("fused kernels need the `cuda` feature".into())
}
pub(super) fn aligned16(_: &Tensor) -> bool {
    false
}
pub(super) fn write_u32(_: &Tensor, _: &[u32]) -> Result<()> {
    Err(off())
}
pub(super) fn gemv(_: &Tensor, _: &Tensor, _: Option<&Tensor>, _: super::Launch) -> Result<Tensor> {
    Err(off())
}
pub(super) fn add_rmsnorm(
    _: &Tensor,
    _: Option<&Tensor>,
    _: &Tensor,
    _: f32,
    _: super::Launch,
) -> Result<(Tensor, Tensor)> {
    Err(off())
}
#[allow(clippy::too_many_arguments)]
pub(super) fn qkv_rope_cache(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: AttnShape,
    _: bool,
    _: super::Launch,
) -> Result<Tensor> {
    Err(off())
}
#[allow(clippy::too_many_arguments)]
pub(super) fn qkv_rope_rows(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: super::RowSlots<'_>,
    _: AttnShape,
    _: bool,
    _: super::Launch,
) -> Result<Tensor> {
    Err(off())
}
pub(super) fn decode_attention(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: AttnShape,
    _: f32,
    _: super::Launch,
) -> Result<Tensor> {
    Err(off())
}
pub(super) fn bi_matmul(
    _: &Tensor,
    _: &Tensor,
    _: Option<&Tensor>,
    _: super::Launch,
) -> Result<Tensor> {
    Err(off())
}
pub(super) fn rows_attention(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &super::PassKeys,
    _: AttnShape,
    _: f32,
    _: super::Launch,
) -> Result<Tensor> {
    Err(off())
}
pub(super) fn silu_mul(_: &Tensor, _: super::Launch) -> Result<Tensor> {
    Err(off())
}
pub(super) fn top_rows(_: &Tensor, _: usize, _: super::Launch) -> Result<Tensor> {
    Err(off())
}
pub(super) fn argmax_rows(_: &[&Tensor], _: super::Launch) -> Result<Tensor> {
    Err(off())
}
pub(super) fn greedy_rows(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: super::Launch,
) -> Result<Tensor> {
    Err(off())
}
pub(super) fn greedy_head(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: super::Launch,
) -> Result<()> {
    Err(off())
}
pub(super) fn addresses(_: &[&Tensor]) -> Result<Vec<u64>> {
    Err(off())
}
pub(super) fn move_entries(
    _: &Tensor,
    _: (usize, usize, usize, usize, usize),
    _: super::Launch,
) -> Result<()> {
    Err(off())
}
#[allow(clippy::too_many_arguments)]
pub(super) fn qkv_rope_sessions(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &super::SessionTable,
    _: usize,
    _: AttnShape,
    _: bool,
    _: super::Launch,
) -> Result<Tensor> {
    Err(off())
}
pub(super) fn sessions_attention(
    _: &Tensor,
    _: &super::SessionTable,
    _: usize,
    _: AttnShape,
    _: f32,
    _: super::Launch,
) -> Result<Tensor> {
    Err(off())
}
pub(super) fn draft_attention(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &super::PassKeys,
    _: AttnShape,
    _: f32,
    _: super::Launch,
) -> Result<Tensor> {
    Err(off())
}
pub(super) fn draft_sessions_attention(
    _: &Tensor,
    _: &super::SessionTable,
    _: usize,
    _: AttnShape,
    _: f32,
    _: super::Launch,
) -> Result<Tensor> {
    Err(off())
}

//! Moving cache entries between slots ([`move_entries`]): a pre-draft keeps the rows its growth
//! computed for the branch a verdict selected by moving them into the sequence.

use super::{applies, imp, sessions::address_words, Launch};
use candle_core::{Error, Result, Tensor};

/// Most entries one [`move_entries`] moves (`MOVE_MAX` of `src/cuda/cache.cu`).
pub const MOVE_MAX: usize = 8;

/// Copies, in every buffer of `buffers` (each a `(1, kv, capacity, head_dim)` cache buffer of
/// one shape), entry `from` to entry `to` for every `(from, to)` of `moves` (at most
/// [`MOVE_MAX`], destinations distinct). Every source is read before any destination is
/// written, so the two sets may overlap. On CUDA with bf16 buffers one launch for all of
/// them; elsewhere candle's copies.
pub fn move_entries(buffers: &[&Tensor], moves: &[(usize, usize)], launch: Launch) -> Result<()> {
    let Some(first) = buffers.first() else {
        return Ok(());
    };
    let (one, kv, capacity, head_dim) = first.dims4()?;
    let fits = buffers
        .iter()
        .all(|b| b.dims() == first.dims() && b.dtype() == first.dtype() && b.is_contiguous());
    if one != 1 || !fits {
        return Err(Error::Msg(format!(
            "moving cache entries needs contiguous (1, kv, capacity, head_dim) buffers of one \
             shape and dtype, got {:?} {:?} among {}",
            first.dims(),
            first.dtype(),
            buffers.len()
        )));
    }
    let bad = moves.len() > MOVE_MAX
        || moves.iter().any(|&(f, t)| f >= capacity || t >= capacity)
        || moves
            .iter()
            .enumerate()
            .any(|(i, m)| moves[..i].iter().any(|n| n.1 == m.1));
    if bad {
        return Err(Error::Msg(format!(
            "cannot move entries {moves:?} of {capacity} (at most {MOVE_MAX}, distinct \
             destinations)"
        )));
    }
    if moves.is_empty() {
        return Ok(());
    }
    if buffers.iter().all(|b| applies(b)) && head_dim.is_multiple_of(2) {
        let mut words = address_words(&imp::addresses(buffers)?);
        words.extend(moves.iter().map(|m| m.0 as u32));
        words.extend(moves.iter().map(|m| m.1 as u32));
        let table = Tensor::new(words.as_slice(), first.device())?;
        let shape = (buffers.len(), moves.len(), kv, capacity, head_dim);
        return imp::move_entries(&table, shape, launch);
    }
    let from: Vec<u32> = moves.iter().map(|m| m.0 as u32).collect();
    let from = Tensor::new(from.as_slice(), first.device())?;
    for b in buffers {
        // The sources, copied out before any destination is written.
        let rows = b.index_select(&from, 2)?;
        for (i, &(_, to)) in moves.iter().enumerate() {
            b.slice_set(&rows.narrow(2, i, 1)?.contiguous()?, 2, to)?;
        }
    }
    Ok(())
}

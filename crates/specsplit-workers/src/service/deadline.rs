//! The deadline a client gives its request (gRPC's `grpc-timeout` header), so that model work
//! whose answer nobody waits for any more stops at its next checkpoint instead of holding the
//! device (or, on a CPU, the cores the target shares) for seconds.

use std::time::{Duration, Instant};

use tonic::metadata::MetadataMap;

/// The longest `grpc-timeout` value: at most 8 digits, then the unit.
const MAX_DIGITS: usize = 8;

/// When the request received at `start` stops being waited for: `start` plus its
/// `grpc-timeout`, or `None` when it carries none (or one that is not well formed: the
/// request then runs to its end, as a request without a timeout does).
pub(crate) fn request_deadline(metadata: &MetadataMap, start: Instant) -> Option<Instant> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    start.checked_add(parse_timeout(value)?)
}

/// A `grpc-timeout` value: 1 to 8 ASCII digits and a unit, `H`, `M`, `S`, `m`, `u` or `n`.
fn parse_timeout(value: &str) -> Option<Duration> {
    let (&unit, digits) = value.as_bytes().split_last()?;
    if digits.is_empty() || digits.len() > MAX_DIGITS || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n = digits
        .iter()
        .fold(0u64, |n, &d| n * 10 + u64::from(d - b'0'));
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_unit_of_the_grpc_timeout_header_is_read() {
        assert_eq!(parse_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse_timeout("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_timeout("5000m"), Some(Duration::from_millis(5000)));
        assert_eq!(parse_timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(
            parse_timeout("99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
    }

    #[test]
    fn malformed_timeouts_give_no_deadline() {
        for bad in ["", "m", "5", "5x", "-5m", "123456789m", "5 m", "5mm", "ä"] {
            assert_eq!(parse_timeout(bad), None, "{bad:?}");
        }
        let mut md = MetadataMap::new();
        md.insert("grpc-timeout", "soon".parse().unwrap());
        assert_eq!(request_deadline(&md, Instant::now()), None);
    }

    #[test]
    fn a_request_deadline_is_its_start_plus_the_timeout() {
        let start = Instant::now();
        let mut md = MetadataMap::new();
        assert_eq!(request_deadline(&md, start), None);
        md.insert("grpc-timeout", "250m".parse().unwrap());
        assert_eq!(
            request_deadline(&md, start),
            Some(start + Duration::from_millis(250))
        );
    }
}

//! Stop strings: generated text cut before the first stop string, streamed without ever
//! emitting a part of one.

/// A generation's text as it streams, cut before the first of its stop strings.
///
/// Text that could be the start of a stop string is held back until the next piece shows
/// whether it is; once a stop string appears, nothing from it on is emitted.
#[derive(Debug, Default)]
pub struct StopText {
    stops: Vec<String>,
    text: String,
    /// Bytes of `text` emitted so far.
    sent: usize,
    stopped: bool,
}

impl StopText {
    /// A text that stops at any of `stops` (empty ones are ignored).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            ..Self::default()
        }
    }

    /// Appends `piece` and returns the text that is now safe to emit.
    pub fn push(&mut self, piece: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.text.push_str(piece);
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        // A stop string that ends in the new piece starts at most `longest` bytes before it.
        let mut from = self.sent.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min();
        let end = match first {
            Some(at) => {
                self.stopped = true;
                self.text.truncate(at.max(self.sent));
                self.text.len()
            }
            None => self.text.len() - self.held_back(),
        };
        let out = self.text[self.sent..end].to_string();
        self.sent = end;
        out
    }

    /// Bytes at the end of the text that begin some stop string.
    fn held_back(&self) -> usize {
        self.stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&k| s.is_char_boundary(k))
                    .map(move |k| &s[..k])
            })
            .filter(|p| self.text.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0)
    }

    /// Whether a stop string appeared.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Ends the text: returns what was held back (it never became a stop string).
    pub fn finish(&mut self) -> String {
        let out = self.text[self.sent..].to_string();
        self.sent = self.text.len();
        out
    }

    /// The text emitted so far.
    pub fn emitted(&self) -> &str {
        &self.text[..self.sent]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(stops: &[&str], pieces: &[&str]) -> (Vec<String>, String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut t = StopText::new(&stops);
        let mut out: Vec<String> = pieces.iter().map(|p| t.push(p)).collect();
        out.push(t.finish());
        (out, t.emitted().to_string(), t.stopped())
    }

    #[test]
    fn text_stops_before_a_stop_string_split_over_pieces() {
        let (out, text, stopped) = stream(&["END"], &["ab", "cE", "N", "Dxyz", "more"]);
        assert_eq!(text, "abc");
        assert!(stopped);
        assert_eq!(out.concat(), "abc");
        // "E" and "N" are held back until they turn out to be the stop string.
        assert_eq!(out[1], "c");
        assert_eq!(out[2], "");
    }

    #[test]
    fn held_back_text_that_is_no_stop_string_comes_out() {
        let (out, text, stopped) = stream(&["END"], &["aE", "Nb", "E"]);
        assert_eq!(out, vec!["a", "ENb", "", "E"]);
        assert_eq!(text, "aENbE");
        assert!(!stopped);
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins() {
        let (_, text, _) = stream(&["zz", "b"], &["a", "bzz"]);
        assert_eq!(text, "a");
        let (_, text, _) = stream(&["\n\n", "."], &["one. two\n\n"]);
        assert_eq!(text, "one");
    }

    #[test]
    fn multi_byte_text_and_no_stops_pass_through() {
        let (_, text, stopped) = stream(&[], &["héllo", " wörld"]);
        assert_eq!((text.as_str(), stopped), ("héllo wörld", false));
        let (_, text, _) = stream(&["ö"], &["héllo", " wörld"]);
        assert_eq!(text, "héllo w");
    }
}

//! A request head read as it passes through, to find a `Content-Length` line: a request with one and a `Transfer-Encoding` too is refused (request smuggling), which hyper alone does not do.

/// Finds a `Content-Length` line in a request head arriving in pieces, up to
/// the head's end (the body is not looked at).
#[derive(Default)]
pub(crate) struct HeadScan {
    /// The last piece ended within a line start: a line feed, then these bytes.
    pending: Option<([u8; 16], u8)>,
    done: bool,
}

enum Line {
    End,
    ContentLength,
    Other,
    NeedMore,
}

const CL: &[u8] = b"content-length:";

/// What the bytes after a line feed start: the head's end, a `Content-Length`
/// line, another line, or too few bytes to tell.
fn classify(rest: &[u8]) -> Line {
    match rest.first() {
        None => Line::NeedMore,
        Some(b'\n') => Line::End,
        Some(b'\r') => match rest.get(1) {
            None => Line::NeedMore,
            Some(b'\n') => Line::End,
            Some(_) => Line::Other,
        },
        Some(_) => {
            let n = rest.len().min(CL.len());
            if !rest[..n].eq_ignore_ascii_case(&CL[..n]) {
                Line::Other
            } else if n == CL.len() {
                Line::ContentLength
            } else {
                Line::NeedMore
            }
        }
    }
}

impl HeadScan {
    pub fn reset(&mut self) {
        *self = HeadScan::default();
    }

    /// Feeds the next bytes of the head; true when a `Content-Length` line was seen.
    pub fn feed(&mut self, data: &[u8]) -> bool {
        if self.done {
            return false;
        }
        let mut found = false;
        if let Some((mut joined, have)) = self.pending.take() {
            // Finish the line start the last piece ended in.
            let have = have as usize;
            let take = (joined.len() - have).min(data.len());
            joined[have..have + take].copy_from_slice(&data[..take]);
            match classify(&joined[..have + take]) {
                Line::End => {
                    self.done = true;
                    return false;
                }
                Line::ContentLength => found = true,
                Line::Other => {}
                Line::NeedMore => {
                    self.pending = Some((joined, (have + take) as u8));
                    return false;
                }
            }
        }
        for nl in memchr::memchr_iter(b'\n', data) {
            let rest = &data[nl + 1..];
            match classify(rest) {
                Line::End => {
                    self.done = true;
                    return found;
                }
                Line::ContentLength => found = true,
                Line::Other => {}
                Line::NeedMore => {
                    // Fewer bytes than `CL` are left: keep them for the next piece.
                    let mut kept = [0u8; 16];
                    kept[..rest.len()].copy_from_slice(rest);
                    self.pending = Some((kept, rest.len() as u8));
                    return found;
                }
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_pieces(pieces: &[&[u8]]) -> bool {
        let mut s = HeadScan::default();
        let mut found = false;
        for p in pieces {
            found |= s.feed(p);
        }
        found
    }

    #[test]
    fn a_content_length_line_is_found_in_any_case_and_split_anywhere() {
        let head: &[u8] = b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nCONTENT-length: 5\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert!(scan_pieces(&[head]));
        for cut in 1..head.len() {
            assert!(scan_pieces(&[&head[..cut], &head[cut..]]), "cut at {cut}");
        }
        let bytes: Vec<&[u8]> = head.chunks(1).collect();
        assert!(scan_pieces(&bytes));
    }

    #[test]
    fn the_body_and_other_headers_are_not_taken_for_a_content_length() {
        let head: &[u8] = b"POST / HTTP/1.1\r\nX-Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n\ncontent-length: 3\r\n";
        assert!(!scan_pieces(&[head]));
        for cut in 1..head.len() {
            assert!(!scan_pieces(&[&head[..cut], &head[cut..]]), "cut at {cut}");
        }
    }
}

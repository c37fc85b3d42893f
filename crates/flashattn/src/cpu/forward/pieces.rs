//! How the forward cuts a key block between the two panels of a pair: the keys both panels see
//! are multiplied once for both, the keys only one sees (the ends of a causal or window
//! diagonal) for that one alone, and the keys both see are cut again where a panel stops
//! seeing all of them, so that the products' register maxima stay exact.

use std::ops::Range;

/// Keys of a block multiplied by one panel of a pair, or by both.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) keys: Range<usize>,
    /// The panel (0 or 1), or the first of the two.
    pub(crate) first: usize,
    pub(crate) both: bool,
}

impl Piece {
    /// The panels (0, 1 or both) the piece is multiplied by.
    pub(crate) fn panels(&self) -> Range<usize> {
        self.first..self.first + 1 + usize::from(self.both)
    }
}

/// True when `inner` lies within `outer` (an empty `inner` always does).
pub(crate) fn contains(outer: &Range<usize>, inner: &Range<usize>) -> bool {
    inner.is_empty() || (outer.start <= inner.start && inner.end <= outer.end)
}

/// The keys each panel of a pair sees (`seen`, empty for a missing panel), cut into pieces:
/// the keys both see, once for both, then what only one sees, for that one (at most seven).
/// The keys both see are cut again where they leave `full` (the keys every query of a panel
/// sees) of either panel, so that the products' maxima of the piece in between are exact for
/// both panels (that cut moves back to a whole number of four-key groups; a piece reaching
/// past a panel's `full` keys gets that panel's maxima after the mask).
pub(crate) fn pieces(seen: &[Range<usize>; 2], full: &[Range<usize>; 2]) -> [Option<Piece>; 7] {
    let mut out: [Option<Piece>; 7] = Default::default();
    let piece =
        |first, keys: Range<usize>, both| (!keys.is_empty()).then_some(Piece { keys, first, both });
    let common = seen[0].start.max(seen[1].start)..seen[0].end.min(seen[1].end);
    if seen.iter().any(|r| r.is_empty()) || common.is_empty() {
        out[0] = piece(0, seen[0].clone(), false);
        out[1] = piece(1, seen[1].clone(), false);
        return out;
    }
    let mut core = full[0].start.max(full[1].start).max(common.start)
        ..full[0].end.min(full[1].end).min(common.end);
    // A whole number of the products' four-key groups: a causal diagonal's core ends one key
    // past a multiple of 16, and the leftover keys move to the next piece (whose maxima come
    // after the mask anyway) instead of running as a 1-key product.
    if core.len() > 4 {
        core.end -= core.len() % 4;
    }
    if core.is_empty() {
        out[0] = piece(0, common.clone(), true);
    } else {
        out[0] = piece(0, common.start..core.start, true);
        out[1] = piece(0, core.clone(), true);
        out[2] = piece(0, core.end..common.end, true);
    }
    for (w, keys) in seen.iter().enumerate() {
        out[3 + 2 * w] = piece(w, keys.start..common.start, false);
        out[4 + 2 * w] = piece(w, common.end..keys.end, false);
    }
    out
}

/// `pieces` with neighbours on the same panels joined: the keys both panels see become one
/// piece again.
pub(crate) fn merged(pieces: &[Option<Piece>; 7]) -> [Option<Piece>; 7] {
    let mut out: [Option<Piece>; 7] = Default::default();
    let mut n = 0usize;
    for p in pieces.iter().flatten() {
        if let Some(last) = n.checked_sub(1).and_then(|i| out[i].as_mut())
            && (last.first, last.both, last.keys.end) == (p.first, p.both, p.keys.start)
        {
            last.keys.end = p.keys.end;
            continue;
        }
        out[n] = Some(p.clone());
        n += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keys each panel gets from its pieces, and whether any key is multiplied twice.
    fn cover(pieces: &[Option<Piece>; 7]) -> [Vec<usize>; 2] {
        let mut keys: [Vec<usize>; 2] = Default::default();
        for p in pieces.iter().flatten() {
            assert!(!p.keys.is_empty());
            let panels = if p.both { 0..2 } else { p.first..p.first + 1 };
            for w in panels {
                keys[w].extend(p.keys.clone());
            }
        }
        for k in &mut keys {
            let n = k.len();
            k.sort();
            k.dedup();
            assert_eq!(k.len(), n, "a key multiplied twice for one panel");
        }
        keys
    }

    #[test]
    fn pieces_cover_each_panel_exactly_once() {
        let cases = [
            // (seen, full): causal diagonal, sliding window, full, disjoint, one panel, the
            // first panel seeing nothing, nested.
            ([0..32, 0..48], [0..17, 0..33]),
            ([10..40, 26..56], [25..41, 41..41]),
            ([0..256, 0..256], [0..256, 0..256]),
            ([0..8, 100..120], [0..8, 100..120]),
            ([5..9, 0..0], [5..9, 0..0]),
            ([0..0, 3..7], [0..0, 3..7]),
            ([20..30, 0..64], [22..28, 10..60]),
        ];
        for (seen, full) in cases {
            let pieces = pieces(&seen, &full);
            let got = cover(&pieces);
            for w in 0..2 {
                assert_eq!(got[w], seen[w].clone().collect::<Vec<_>>(), "{seen:?}");
            }
            // The keys both panels see in full run as whole four-key groups (or fewer than
            // four keys); a piece that straddles the end of a panel's full keys took at most
            // three of them, and none straddles a start.
            for p in pieces.iter().flatten().filter(|p| p.both) {
                if full.iter().all(|f| contains(f, &p.keys)) {
                    assert!(p.keys.len() % 4 == 0 || p.keys.len() < 4, "{p:?}");
                }
                for f in &full {
                    let inside = |edge: usize| p.keys.start < edge && edge < p.keys.end;
                    assert!(!inside(f.start), "{p:?} {f:?}");
                    if inside(f.end) {
                        assert!(f.end - p.keys.start < 4, "{p:?} {f:?}");
                    }
                }
            }
            // Merged, the pieces still cover each panel's keys once, in fewer products.
            let joined = merged(&pieces);
            assert_eq!(cover(&joined), got);
            assert!(joined.iter().flatten().count() <= pieces.iter().flatten().count());
        }
        let all = pieces(&[0..256, 0..256], &[0..256, 0..256]);
        assert_eq!(all.iter().flatten().count(), 1);
        assert!(all.iter().flatten().all(|p| p.both && p.keys == (0..256)));
        let causal = pieces(&[0..32, 0..48], &[0..17, 0..33]);
        let got: Vec<_> = causal.iter().flatten().cloned().collect();
        let want = [(0..16, 0, true), (16..32, 0, true), (32..48, 1, false)];
        assert_eq!(got.len(), want.len());
        for (p, (keys, first, both)) in got.iter().zip(want) {
            assert_eq!((p.keys.clone(), p.first, p.both), (keys, first, both));
        }
        let joined: Vec<_> = merged(&causal).into_iter().flatten().collect();
        let want = [(0..32, 0, true), (32..48, 1, false)];
        assert_eq!(joined.len(), want.len());
        for (p, (keys, first, both)) in joined.iter().zip(want) {
            assert_eq!((p.keys.clone(), p.first, p.both), (keys, first, both));
        }
    }
}

//! Model-name patterns in a price sheet: `*` matches any run of characters
//! (none too), `?` exactly one; every other character is itself. There is no
//! escape: a model name with a literal `*` or `?` cannot be priced exactly.

use std::cmp::Reverse;

/// Whether the sheet key `key` is a pattern (has a `*` or a `?`).
pub(crate) fn is_pattern(key: &str) -> bool {
    key.contains(['*', '?'])
}

/// A compiled pattern and what orders it against others (see
/// [`Glob::precedence`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Glob {
    key: String,
    chars: Vec<char>,
    literal: usize,
    prefix: usize,
}

impl Glob {
    pub(crate) fn new(key: &str) -> Self {
        let chars: Vec<char> = key.chars().collect();
        let wild = |c: &char| *c == '*' || *c == '?';
        Self {
            key: key.to_owned(),
            literal: chars.iter().filter(|c| !wild(c)).count(),
            prefix: chars.iter().take_while(|c| !wild(c)).count(),
            chars,
        }
    }

    /// How specific the pattern is, smallest first: more literal characters,
    /// then a longer literal prefix (before the first wildcard), then the key
    /// in lexicographic order, so that the order never depends on the file's.
    pub(super) fn precedence(&self) -> (Reverse<usize>, Reverse<usize>, &str) {
        (Reverse(self.literal), Reverse(self.prefix), &self.key)
    }

    /// Whether `name` matches the whole pattern. Linear backtracking on the
    /// last `*`: O(pattern × name) at worst, no recursion.
    pub(crate) fn matches(&self, name: &str) -> bool {
        let name: Vec<char> = name.chars().collect();
        let (mut p, mut n) = (0, 0);
        // The last `*` seen, and where in `name` it started matching.
        let mut star: Option<(usize, usize)> = None;
        while n < name.len() {
            match self.chars.get(p) {
                Some('*') => {
                    star = Some((p, n));
                    p += 1;
                }
                Some(c) if *c == '?' || Some(c) == name.get(n) => {
                    p += 1;
                    n += 1;
                }
                _ => match star {
                    // Let the last `*` take one more character, and retry.
                    Some((sp, sn)) => {
                        star = Some((sp, sn + 1));
                        p = sp + 1;
                        n = sn + 1;
                    }
                    None => return false,
                },
            }
        }
        self.chars.iter().skip(p).all(|c| *c == '*')
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stars_and_question_marks() {
        let m = |p: &str, n: &str| Glob::new(p).matches(n);
        assert!(m("gpt-4o*", "gpt-4o"));
        assert!(m("gpt-4o*", "gpt-4o-mini-2024-07-18"));
        assert!(!m("gpt-4o*", "gpt-4"));
        assert!(!m("gpt-4o*", "xgpt-4o"));
        assert!(m("*-mini", "o4-mini"));
        assert!(!m("*-mini", "o4-mini-high"));
        assert!(m("claude-*-4*", "claude-sonnet-4-20250514"));
        assert!(m("claude-*-4*", "claude-opus-4"));
        assert!(!m("claude-*-4*", "claude-3-5-sonnet"));
        assert!(m("o?", "o3"));
        assert!(!m("o?", "o"));
        assert!(!m("o?", "o3x"));
        assert!(m("a?c", "aéc"), "? is one character, not one byte");
        assert!(m("*", ""));
        assert!(m("**", "anything"));
        assert!(m("a*b*c", "aXXbYYbc"));
        assert!(!m("a*b*c", "aXXbYYb"));
        assert!(m("*a*a*a*a*b", "aaaaaaaaaaaaaaaaaaaab"));
        assert!(!m("*a*a*a*a*b", "aaaaaaaaaaaaaaaaaaaaa"));
    }

    #[test]
    fn more_literal_characters_come_first() {
        let mut globs: Vec<Glob> = [
            "*",
            "gpt-4o*",
            "*-mini*",
            "gpt-4o-mini*",
            "gpt-4o-?ini*",
            "gpt?4o*",
        ]
        .iter()
        .map(|k| Glob::new(k))
        .collect();
        globs.sort_by(|a, b| a.precedence().cmp(&b.precedence()));
        let order: Vec<&str> = globs.iter().map(|g| g.key.as_str()).collect();
        assert_eq!(
            order,
            [
                "gpt-4o-mini*",
                "gpt-4o-?ini*",
                "gpt-4o*",
                "gpt?4o*",
                "*-mini*",
                "*"
            ]
        );
        assert!(is_pattern("gpt-4o*") && is_pattern("o?") && !is_pattern("gpt-4o"));
    }
}

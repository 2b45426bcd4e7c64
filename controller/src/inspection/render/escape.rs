//! Keeps characters that steer a terminal out of `capstan status` output.
//!
//! Handler messages, handler ids and node names come from annotations and status fields that
//! anyone with patch rights on an object can write, and messages quote user content; printed
//! as they are, an ESC starts a terminal escape sequence (moving the cursor, rewriting what is
//! on screen, setting the window title or the clipboard), BEL rings, and bidirectional
//! overrides make text read other than it is stored. So:
//!
//! - **Tables** show every C0 control, DEL and C1 control as `\xNN`, and every bidirectional
//!   formatting character as `\u{NNNN}` ([`escape`]).
//! - **JSON** already escapes C0 controls; DEL, C1 controls and bidirectional formatting
//!   characters are written as `\uNNNN` escapes, which decode to the same strings
//!   ([`json`]).
//! - **YAML**: the emitter writes strings with C0, DEL or C1 controls double-quoted with
//!   escapes; it has no escaped form for bidirectional formatting characters it considers
//!   printable, so those are shown as `\u{NNNN}` text, as in tables ([`escape_bidi`]).

use std::fmt::Write as _;

/// Whether `c` is a C0 control, DEL or a C1 control.
fn is_control(c: char) -> bool {
    c.is_control()
}

/// Whether `c` is a bidirectional formatting character: the embeddings and overrides
/// (U+202A–U+202E), the isolates (U+2066–U+2069) and the marks (U+200E, U+200F, U+061C).
fn is_bidi(c: char) -> bool {
    matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}' | '\u{061c}')
}

/// Whether `s` needs no escaping for a table.
fn is_clean(s: &str) -> bool {
    !s.chars().any(|c| is_control(c) || is_bidi(c))
}

/// `s` for a table cell: controls as `\xNN`, bidirectional formatting as `\u{NNNN}`.
pub fn escape(s: &str) -> String {
    if is_clean(s) {
        return s.to_owned();
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if is_control(c) {
            let _ = write!(out, "\\x{:02x}", u32::from(c));
        } else if is_bidi(c) {
            let _ = write!(out, "\\u{{{:04x}}}", u32::from(c));
        } else {
            out.push(c);
        }
    }
    out
}

/// `s` with only its bidirectional formatting characters spelled as `\u{NNNN}`.
pub fn escape_bidi(s: &str) -> String {
    if !s.chars().any(is_bidi) {
        return s.to_owned();
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if is_bidi(c) {
            let _ = write!(out, "\\u{{{:04x}}}", u32::from(c));
        } else {
            out.push(c);
        }
    }
    out
}

/// Whether JSON text from serde_json may hold `c` unescaped although it steers a terminal:
/// DEL, a C1 control or a bidirectional formatting character. (serde_json escapes C0
/// controls in strings; those outside strings are the layout's whitespace.)
fn is_unescaped_in_json(c: char) -> bool {
    matches!(c, '\x7f'..='\u{9f}') || is_bidi(c)
}

/// JSON text from serde_json with DEL, C1 controls and bidirectional formatting characters
/// written as `\uNNNN` escapes. Outside strings JSON has no such characters, so every one is
/// inside a string, where the escape stands for the same character.
pub fn json(text: String) -> String {
    if !text.chars().any(is_unescaped_in_json) {
        return text;
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if is_unescaped_in_json(c) {
            let _ = write!(out, "\\u{:04x}", u32::from(c));
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_and_bidi_overrides_are_spelled_out() {
        assert_eq!(escape("plain text é"), "plain text é");
        assert_eq!(
            escape("a\x1b[2Jb\x07c\x7fd\u{9b}e\u{202e}f"),
            "a\\x1b[2Jb\\x07c\\x7fd\\x9be\\u{202e}f"
        );
        assert_eq!(escape_bidi("\x1b\u{2066}"), "\x1b\\u{2066}");
    }

    #[test]
    fn json_escapes_decode_to_the_same_strings() {
        let value = serde_json::json!({"m": "a\x1b\x07\x7f\u{9b}\u{202e}z"});
        let text = json(serde_json::to_string_pretty(&value).unwrap());
        assert!(
            text.chars().all(|c| c == '\n' || !is_control(c) && !is_bidi(c)),
            "{text}"
        );
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back, value);
    }
}

//! The one escaping of text taken from traces, file names and errors for HTML and XML (the
//! HTML report, the gate's JUnit XML).

/// Text for HTML or XML character data or a double-quoted attribute: the five special characters
/// as character references; newline, carriage return and tab as numeric references (an
/// attribute would normalise them to spaces); every other control character, and the
/// non-characters U+FFFE/U+FFFF, which XML 1.0 does not allow, as U+FFFD.
pub fn markup(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if let Some(e) = entity(c) {
            out.push_str(e);
            continue;
        }
        match c {
            '\n' => out.push_str("&#10;"),
            '\r' => out.push_str("&#13;"),
            '\t' => out.push_str("&#9;"),
            c if c.is_control() || c == '\u{FFFE}' || c == '\u{FFFF}' => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

/// The reference for one of the five characters HTML and XML read as markup (`&`, `<`, `>`, `"`,
/// `'`), or `None` for any other character.
pub fn entity(c: char) -> Option<&'static str> {
    Some(match c {
        '&' => "&amp;",
        '<' => "&lt;",
        '>' => "&gt;",
        '"' => "&quot;",
        '\'' => "&#39;",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markup_quotes_and_controls_are_escaped() {
        assert_eq!(
            markup("<script>\"a\" & 'b'</script>"),
            "&lt;script&gt;&quot;a&quot; &amp; &#39;b&#39;&lt;/script&gt;"
        );
        assert_eq!(
            markup("a\u{1}\td\n\u{85}\u{FFFF}"),
            "a\u{FFFD}&#9;d&#10;\u{FFFD}\u{FFFD}"
        );
        assert_eq!(markup("L0.attn.q @1"), "L0.attn.q @1");
        assert_eq!(markup("]]>"), "]]&gt;");
    }
}

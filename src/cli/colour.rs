//! Whether kmqd colours what it prints, decided once per stream: only when the stream is a terminal, and never
//! when `NO_COLOR` is set to anything but the empty string (<https://no-color.org>). Everything kmqd colours goes
//! through here: the log lines on standard error and `kmqd stats --watch`. The scripts follow the same rule with
//! `use_colour` in scripts/common.sh.

use std::ffi::OsStr;
use std::io::IsTerminal;

/// The decision for one stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Colour(bool);

/// What a piece of text is, which decides how it is painted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Style {
    Plain,
    /// Titles.
    Bold,
    /// Column headers: reverse video.
    Header,
    /// Secondary detail.
    Dim,
    /// Worth a look: a paused queue.
    Warn,
    /// Something is wrong: an error, failing runs.
    Bad,
}

impl Colour {
    /// For standard output.
    pub(crate) fn stdout() -> Colour {
        Colour::decide(
            std::io::stdout().is_terminal(),
            std::env::var_os("NO_COLOR").as_deref(),
        )
    }

    /// For standard error (the log lines).
    pub(crate) fn stderr() -> Colour {
        Colour::decide(
            std::io::stderr().is_terminal(),
            std::env::var_os("NO_COLOR").as_deref(),
        )
    }

    /// The rule itself: a terminal, and `NO_COLOR` unset or empty.
    pub(crate) fn decide(is_terminal: bool, no_color: Option<&OsStr>) -> Colour {
        Colour(is_terminal && no_color.is_none_or(OsStr::is_empty))
    }

    pub(crate) fn enabled(self) -> bool {
        self.0
    }

    /// `text` with the SGR codes of `style` around it, or as it is without colour.
    pub(crate) fn paint(self, style: Style, text: &str) -> String {
        let code = match style {
            Style::Plain => return text.to_string(),
            Style::Bold => "1",
            Style::Header => "7",
            Style::Dim => "2",
            Style::Warn => "33",
            Style::Bad => "31",
        };
        if self.0 {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_string()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        let set = Some(OsStr::new("1"));
        let empty = Some(OsStr::new(""));
        assert!(Colour::decide(true, None).enabled());
        assert!(
            Colour::decide(true, empty).enabled(),
            "an empty NO_COLOR is unset"
        );
        assert!(!Colour::decide(true, set).enabled());
        assert!(!Colour::decide(false, None).enabled());
        assert!(!Colour::decide(false, set).enabled());
    }

    #[test]
    fn paint_adds_codes_only_when_enabled() {
        assert_eq!(
            Colour::decide(true, None).paint(Style::Bad, "x"),
            "\x1b[31mx\x1b[0m"
        );
        assert_eq!(Colour::decide(false, None).paint(Style::Bad, "x"), "x");
        assert_eq!(Colour::decide(true, None).paint(Style::Plain, "x"), "x");
    }
}

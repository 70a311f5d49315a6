//! Turns library errors into miette reports: spec errors point into the spec's source with the
//! field's span, mesh errors name the axis and the fix. Only the CLI depends on miette.

use miette::{Diagnostic, NamedSource, SourceSpan};
use shardc_ir::mesh::MeshError;
use shardc_ir::spec::{SpecError, SpecErrors};

/// One spec error, located in its source.
#[derive(Debug, thiserror::Error, Diagnostic)]
#[error("{title}")]
struct FieldDiagnostic {
    title: String,
    #[source_code]
    source_code: NamedSource<String>,
    #[label("{label}")]
    span: Option<SourceSpan>,
    label: String,
    #[help]
    help: Option<String>,
}

/// Several spec errors: a headline plus one related diagnostic each.
#[derive(Debug, thiserror::Error, Diagnostic)]
#[error("invalid model spec {name}: {count} errors")]
#[diagnostic(help("fix every field listed below; each points at its place in the file"))]
struct SpecDiagnostic {
    name: String,
    count: usize,
    #[related]
    errors: Vec<FieldDiagnostic>,
}

fn field_diagnostic(errors: &SpecErrors, e: &SpecError, headline: bool) -> FieldDiagnostic {
    let title = if !headline {
        format!("field `{}`: {}", e.field, e.message)
    } else if e.field.is_empty() {
        format!("invalid model spec {}: {}", errors.source_name, e.message)
    } else {
        format!("invalid model spec {}: field `{}`: {}", errors.source_name, e.field, e.message)
    };
    let (source_code, span) = located(&errors.source_name, &errors.text, e.span.clone());
    FieldDiagnostic { title, source_code, span, label: if e.field.is_empty() { "here".into() } else { e.field.clone() }, help: e.help.clone() }
}

/// Longest source line shown whole under an error; longer ones are cut to the span and
/// [`EXCERPT_CONTEXT`] bytes around it (miette renders a line whole: a spec of one 15 MB line
/// took half a minute and printed all of it).
const MAX_SHOWN_LINE: usize = 512;

/// Bytes of a long line shown on each side of the span.
const EXCERPT_CONTEXT: usize = 80;

/// Longest span marked in an excerpt.
const MAX_MARKED: usize = 160;

/// The source to show under an error at `span` of `text`, and the span in it: the file as it
/// is, or, when the span's line is too long to show, an excerpt of that line around the span
/// named after the file with its line and columns.
fn located(name: &str, text: &str, span: Option<std::ops::Range<usize>>) -> (NamedSource<String>, Option<SourceSpan>) {
    let Some(span) = span else {
        // Without a span nothing of the source is shown.
        return (NamedSource::new(name, String::new()), None);
    };
    let floor = |mut i: usize| {
        i = i.min(text.len());
        while !text.is_char_boundary(i) {
            i -= 1;
        }
        i
    };
    let (start, end) = (floor(span.start), floor(span.end.max(span.start)));
    let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[end..].find('\n').map_or(text.len(), |i| end + i);
    if line_end - line_start <= MAX_SHOWN_LINE {
        return (NamedSource::new(name, text.to_string()), Some(SourceSpan::from(start..end)));
    }
    let marked_end = floor(end.min(start.saturating_add(MAX_MARKED)));
    let (from, to) = (floor(start.saturating_sub(EXCERPT_CONTEXT).max(line_start)), floor(marked_end.saturating_add(EXCERPT_CONTEXT).min(line_end)));
    let (before, after) = (if from > line_start { "..." } else { "" }, if to < line_end { "..." } else { "" });
    let excerpt = format!("{before}{}{after}", &text[from..to]);
    let line = text[..start].matches('\n').count() + 1;
    let column = text[line_start..start].chars().count() + 1;
    let named = format!("{name}, line {line} from column {column} (an excerpt of a {}-byte line)", line_end - line_start);
    let offset = before.len() + start - from;
    (NamedSource::new(named, excerpt), Some(SourceSpan::from(offset..offset + (marked_end - start))))
}

/// A report for every error of a spec.
pub fn spec_report(errors: SpecErrors) -> miette::Report {
    if errors.errors.len() == 1 {
        return miette::Report::new(field_diagnostic(&errors, &errors.errors[0], true));
    }
    let diagnostics = errors.errors.iter().map(|e| field_diagnostic(&errors, e, false)).collect();
    miette::Report::new(SpecDiagnostic { name: errors.source_name.clone(), count: errors.errors.len(), errors: diagnostics })
}

/// A problem with `--mesh`.
#[derive(Debug, thiserror::Error, Diagnostic)]
#[error("invalid --mesh: {}", messages.join("; "))]
struct MeshDiagnostic {
    messages: Vec<String>,
    #[help]
    help: String,
}

/// A report for mesh errors.
pub fn mesh_report(errors: Vec<MeshError>) -> miette::Report {
    let help = errors.iter().map(|e| e.help.clone()).collect::<Vec<_>>().join("; ");
    miette::Report::new(MeshDiagnostic { messages: errors.into_iter().map(|e| e.message).collect(), help })
}

/// Longest line of an error report, in characters; the middle of a longer one (a 15 MB value
/// quoted by a parser) is elided.
const MAX_REPORT_LINE: usize = 2000;

/// Most lines of a report made safe; the rest are counted, not shown.
const MAX_REPORT_LINES: usize = 400;

/// The report hook of the CLI: miette's own rendering (colours on a terminal), unless the
/// report holds control characters of its own (terminal escapes from a spec, a config or a
/// plan) or a line longer than [`MAX_REPORT_LINE`]. Then it is rendered without colours,
/// every control character but newline and tab written as `\u{..}`, and long lines cut, so
/// no input can move the cursor, clear the screen or flood the terminal.
pub fn install_terminal_safe_reports() {
    let _ = miette::set_hook(Box::new(|_| Box::new(TerminalSafe { styled: miette::MietteHandlerOpts::new().build() })));
}

struct TerminalSafe {
    styled: miette::MietteHandler,
}

/// A rendering by one handler, as `Display`.
struct Rendered<'a>(&'a dyn miette::ReportHandler, &'a dyn Diagnostic);

impl std::fmt::Display for Rendered<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.debug(self.1, f)
    }
}

impl miette::ReportHandler for TerminalSafe {
    fn debug(&self, diagnostic: &dyn Diagnostic, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A message too long to show (a parser quoting a huge value) is shown cut, with its
        // help, before any rendering: wrapping megabytes of text would take long.
        let message = diagnostic.to_string();
        if message.len() > MAX_REPORT_LINE * 4 {
            let help = diagnostic.help().map(|h| h.to_string());
            let short = make_terminal_safe(&message);
            let cut: miette::Report = match help {
                Some(help) => miette::miette!(help = make_terminal_safe(&help), "{short}"),
                None => miette::miette!("{short}"),
            };
            return self.debug(cut.as_ref(), f);
        }
        let plain_handler = miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode_nocolor());
        let plain = Rendered(&plain_handler, diagnostic).to_string();
        if terminal_safe(&plain) {
            return self.styled.debug(diagnostic, f);
        }
        f.write_str(&make_terminal_safe(&plain))
    }
}

/// Whether text holds no control character but newline and tab, and no line longer than
/// [`MAX_REPORT_LINE`] characters.
fn terminal_safe(text: &str) -> bool {
    text.lines().all(|line| line.chars().count() <= MAX_REPORT_LINE && !line.chars().any(|c| c.is_control() && c != '\t'))
}

/// `text` with control characters (but newline and tab) escaped and over-long lines cut in
/// the middle.
pub fn make_terminal_safe(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(1 << 20));
    let lines = text.split('\n').count();
    for (k, line) in text.split('\n').enumerate() {
        if k > 0 {
            out.push('\n');
        }
        if k == MAX_REPORT_LINES {
            out.push_str(&format!("… ({} more lines)", lines - k));
            break;
        }
        let mut escaped = String::new();
        for c in line.chars() {
            if c.is_control() && c != '\t' {
                escaped.extend(c.escape_unicode());
            } else {
                escaped.push(c);
            }
        }
        let count = escaped.chars().count();
        if count > MAX_REPORT_LINE {
            let keep = MAX_REPORT_LINE / 2;
            let head: String = escaped.chars().take(keep).collect();
            let tail: String = escaped.chars().skip(count - keep).collect();
            out.push_str(&format!("{head} … ({} characters elided) … {tail}", count - 2 * keep));
        } else {
            out.push_str(&escaped);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_and_long_lines_are_made_safe() {
        assert!(terminal_safe("plain\ttext\nline two"));
        assert!(!terminal_safe("x\u{1b}[2Jy"));
        assert_eq!(make_terminal_safe("x\u{1b}[2Jy\nnext\u{7}"), "x\\u{1b}[2Jy\nnext\\u{7}");
        let long = "v".repeat(10 * MAX_REPORT_LINE);
        assert!(!terminal_safe(&long));
        let cut = make_terminal_safe(&format!("invalid type: string \"{long}\""));
        assert!(cut.chars().count() < MAX_REPORT_LINE + 100 && cut.contains("characters elided") && cut.starts_with("invalid type"), "{}", cut.len());
        let many = "line\n".repeat(10 * MAX_REPORT_LINES);
        assert!(make_terminal_safe(&many).ends_with(&format!("… ({} more lines)", 9 * MAX_REPORT_LINES + 1)));
    }
}

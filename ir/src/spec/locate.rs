//! Finds the byte span of a field (`model.heads`) in a spec's source, so that validation
//! errors found after deserialization can point at the text.

use std::ops::Range;

use super::Format;

/// Span of `section.key = value` (TOML) or `"key": value` inside `"section"` (JSON); for a
/// defaulted field that is absent, the span of its section header.
pub fn field_span(source: &str, format: Format, field: &str) -> Option<Range<usize>> {
    let Some((section, key)) = field.split_once('.') else {
        // A whole section: its header, or nothing if it is absent.
        return match format {
            Format::Toml => toml_edit::Document::parse(source).ok()?.as_table().key(field)?.span(),
            Format::Json => source.find(&format!("\"{field}\"")).map(|at| at..at + field.len() + 2),
        };
    };
    match format {
        Format::Toml => toml_span(source, section, key),
        Format::Json => json_span(source, section, key),
    }
}

fn toml_span(source: &str, section: &str, key: &str) -> Option<Range<usize>> {
    let doc = toml_edit::Document::parse(source).ok()?;
    let table = doc.as_table().get(section)?.as_table_like()?;
    match table.get_key_value(key) {
        Some((k, item)) => {
            let start = k.span()?.start;
            Some(start..item.span().map_or(start, |s| s.end))
        }
        // Absent (defaulted) field: point at the section.
        None => doc.as_table().get_key_value(section).and_then(|(k, _)| k.span()),
    }
}

fn json_span(source: &str, section: &str, key: &str) -> Option<Range<usize>> {
    // A plain scan is enough for the flat two-level layout of a spec: find the section's key,
    // then the field's key after it.
    let section_at = source.find(&format!("\"{section}\""))?;
    let needle = format!("\"{key}\"");
    let Some(rel) = source[section_at..].find(&needle) else {
        return Some(section_at..section_at + section.len() + 2);
    };
    let start = section_at + rel;
    let rest = &source[start..];
    let end = rest.find([',', '}', '\n']).unwrap_or(rest.len());
    Some(start..start + rest[..end].trim_end().len())
}

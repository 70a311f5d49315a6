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
    FieldDiagnostic {
        title,
        source_code: NamedSource::new(&errors.source_name, errors.text.clone()),
        span: e.span.clone().map(|s| SourceSpan::from(s.start..s.end.max(s.start))),
        label: if e.field.is_empty() { "here".into() } else { e.field.clone() },
        help: e.help.clone(),
    }
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

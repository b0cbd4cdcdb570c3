//! Docs that cannot drift: every relative link in the README, `docs/` and the benchmark's README
//! resolves (its file, and its `#anchor` to a heading of that page); the one project layout,
//! in `src/lib.rs`'s docs, names every file under `src/`; every field the configuration reads
//! and every store backend has its row in `docs/configuration.md`, with the default the code
//! uses; and every metric family the registry exposes has its row in `docs/operating.md`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use idemgate::config::Config;

use crate::common::{TestCa, Validity};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// A page of the repository, read whole.
fn page(path: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(path)).unwrap()
}

/// The pages whose links are checked.
fn pages() -> Vec<PathBuf> {
    let root = Path::new(ROOT);
    let mut pages = vec![root.join("README.md"), root.join("loadtest/README.md")];
    for entry in std::fs::read_dir(root.join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    pages
}

/// The targets of the Markdown links `[text](target)` of `text`, outside code blocks.
fn links(text: &str) -> Vec<String> {
    let mut links = Vec::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            if let Some(end) = rest.find(')') {
                links.push(rest[..end].to_string());
                rest = &rest[end..];
            }
        }
    }
    links
}

/// GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown page's headings.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut in_code = false;
    let mut anchors = BTreeSet::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        } else if !in_code && line.starts_with('#') {
            anchors.insert(anchor(line.trim_start_matches('#')));
        }
    }
    anchors
}

#[test]
fn every_relative_link_resolves() {
    let mut broken = Vec::new();
    let pages = pages();
    assert!(pages.len() > 5, "{pages:?}");
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (file, fragment) = link.split_once('#').unwrap_or((&link, ""));
            let target = if file.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(file)
            };
            if !target.exists() {
                broken.push(format!("{}: {link} (no such file)", page.display()));
                continue;
            }
            if !fragment.is_empty() && target.extension().is_some_and(|e| e == "md") {
                let headings = anchors(&std::fs::read_to_string(&target).unwrap());
                if !headings.contains(fragment) {
                    broken.push(format!("{}: {link} (no such heading)", page.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// Every file under `dir`, as a path relative to `base`.
fn files(base: &Path, dir: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files(base, &path, out);
        } else {
            let relative = path.strip_prefix(base).unwrap();
            out.push(relative.to_string_lossy().replace('\\', "/"));
        }
    }
}

#[test]
fn the_layout_names_every_source_file() {
    let lib = std::fs::read_to_string(Path::new(ROOT).join("src/lib.rs")).unwrap();
    let layout: String = lib
        .lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .skip_while(|l| l.trim() != "# Layout")
        .skip(1)
        .take_while(|l| !l.trim_start().starts_with("# "))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(!layout.is_empty(), "src/lib.rs has a # Layout section");
    let src = Path::new(ROOT).join("src");
    let mut all = Vec::new();
    files(&src, &src, &mut all);
    // A Rust file is named by its path under src/; any other file (a Lua script) by its folder.
    let unnamed: Vec<&String> = all
        .iter()
        .filter(|f| {
            let named = if f.ends_with(".rs") {
                format!("`{f}`")
            } else {
                format!("`{}/`", f.rsplit_once('/').map_or("", |(dir, _)| dir))
            };
            !layout.contains(&named)
        })
        .collect();
    assert!(
        unnamed.is_empty(),
        "not named in src/lib.rs's # Layout: {unnamed:?}"
    );
}

/// The text inside each pair of backticks of `text`.
fn code_spans(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// The lines of the section of `text` under the heading `## {title}`, to the next `## `.
fn section<'a>(text: &'a str, title: &str) -> Vec<&'a str> {
    let heading = format!("## {title}");
    let lines: Vec<&str> = text
        .lines()
        .skip_while(|l| *l != heading)
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .collect();
    assert!(!lines.is_empty(), "no section {heading:?}");
    lines
}

/// The cells of a Markdown table's row that documents something (its first cell in backticks).
fn row_cells(line: &str) -> Option<Vec<&str>> {
    let cells: Vec<&str> = line
        .strip_prefix('|')?
        .strip_suffix('|')?
        .split('|')
        .collect();
    cells.first()?.trim().starts_with('`').then_some(cells)
}

/// One row of a field table of docs/configuration.md.
#[derive(Debug)]
struct FieldRow {
    /// The TOML table it is under: `""` (top level), `upstreams`, `store`, `defaults`, ...
    table: String,
    /// The fields the row documents (most rows one, some a pair).
    fields: Vec<String>,
    /// The default as written.
    default: String,
    /// The meaning as written.
    meaning: String,
}

/// The TOML table a `### ` heading of the fields documents: its first code span without the
/// brackets and the `.NAME` (`[upstreams.NAME]`: `upstreams`); `""` for the top level.
fn heading_table(heading: &str) -> String {
    code_spans(heading).first().map_or(String::new(), |span| {
        let name = span.trim_matches(['[', ']']);
        name.split('.').next().unwrap_or(name).to_string()
    })
}

/// Every row of the field tables of docs/configuration.md, with the tables their headings name.
fn field_rows() -> (Vec<FieldRow>, BTreeSet<String>) {
    let doc = page("docs/configuration.md");
    let (mut rows, mut tables) = (Vec::new(), BTreeSet::new());
    let mut table = None;
    for line in section(&doc, "Fields") {
        if let Some(heading) = line.strip_prefix("### ") {
            // A heading may name more than one table (`[defaults]` and `[[routes]]`).
            for span in code_spans(heading) {
                tables.insert(heading_table(&format!("`{span}`")));
            }
            table = Some(heading_table(heading));
        } else if let Some(cells) = row_cells(line) {
            let table = table.clone().expect("a field row under a ### heading");
            let [fields, default, meaning] = cells[..] else {
                panic!("a field row has three cells: {line}")
            };
            rows.push(FieldRow {
                table,
                fields: code_spans(fields).iter().map(|f| f.to_string()).collect(),
                default: default.trim().to_string(),
                meaning: meaning.trim().to_string(),
            });
        }
    }
    (rows, tables)
}

/// The smallest valid configuration.
const UPSTREAM: &str = "upstream = \"http://127.0.0.1:9000\"\n";

/// A field name no table has, to make the configuration list the ones it has.
const PROBE: &str = "idemgate_docs_probe";

/// The fields the table `toml` opens reads, as the configuration's error for an unknown field
/// lists them (`expected one of `a`, `b``, `expected `a` or `b``).
fn fields_read(toml: &str) -> BTreeSet<String> {
    let error = Config::from_toml(&format!("{toml}\n{PROBE} = 1"))
        .unwrap_err()
        .to_string();
    let expected = error
        .split_once(&format!("unknown field `{PROBE}`, expected "))
        .unwrap_or_else(|| panic!("no list of fields in {error:?}"))
        .1;
    let fields: BTreeSet<String> = code_spans(expected).iter().map(|f| f.to_string()).collect();
    assert!(!fields.is_empty(), "{error}");
    fields
}

/// The store backends, as the configuration's error for an unknown one names them.
fn backends() -> Vec<String> {
    let error = Config::from_toml(&format!("{UPSTREAM}[store]\nbackend = \"{PROBE}\""))
        .unwrap_err()
        .to_string();
    let names = error
        .split_once("is not a backend; use ")
        .unwrap_or_else(|| panic!("no list of backends in {error:?}"))
        .1;
    let names: Vec<String> = names
        .split('"')
        .skip(1)
        .step_by(2)
        .map(String::from)
        .collect();
    assert!(names.len() >= 4, "{error}");
    names
}

/// What a backend needs besides its name to be a valid `[store]` table.
fn backend_table(backend: &str) -> String {
    let required = match backend {
        "memory" => "",
        "embedded" => "path = \"/var/lib/idemgate\"",
        "redis" => "url = \"redis://127.0.0.1:6379/0\"",
        "redis-cluster" => "urls = [\"redis://127.0.0.1:7000\"]",
        "redis-sentinel" => "urls = [\"redis://127.0.0.1:26379\"]\nmaster_name = \"idemgate\"",
        "postgres" => "url = \"postgres://idemgate@127.0.0.1:5432/idemgate\"",
        other => panic!("backend {other:?}: say here what its table requires"),
    };
    format!("{UPSTREAM}[store]\nbackend = \"{backend}\"\n{required}\n")
}

/// Every field the configuration reads, by table (`""`: the top level), from the code itself.
fn fields_by_table() -> Vec<(&'static str, BTreeSet<String>)> {
    let mut store: BTreeSet<String> = backends()
        .iter()
        .flat_map(|b| fields_read(&backend_table(b)))
        .collect();
    // Read before the backend's own table, by every backend.
    store.extend(["backend".to_string(), "seal".to_string()]);
    vec![
        ("", fields_read(UPSTREAM)),
        (
            "upstreams",
            fields_read(&format!("{UPSTREAM}[upstreams.default]")),
        ),
        ("tls", fields_read(&format!("{UPSTREAM}[tls]"))),
        ("store", store),
        ("admin", fields_read(&format!("{UPSTREAM}[admin]"))),
        ("telemetry", fields_read(&format!("{UPSTREAM}[telemetry]"))),
        ("defaults", fields_read(&format!("{UPSTREAM}[defaults]"))),
    ]
}

#[test]
fn every_config_field_has_its_row() {
    let (rows, tables) = field_rows();
    let mut missing = Vec::new();
    let mut stale = Vec::new();
    for (table, fields) in fields_by_table() {
        let documented: BTreeSet<&str> = rows
            .iter()
            .filter(|r| r.table == table)
            .flat_map(|r| r.fields.iter().map(String::as_str))
            .collect();
        for field in &fields {
            // A top-level field that is a table of its own is documented by its heading.
            let heading = table.is_empty() && tables.contains(field);
            if !documented.contains(field.as_str()) && !heading {
                missing.push(format!("[{table}] {field}"));
            }
        }
        stale.extend(
            documented
                .iter()
                .filter(|f| !fields.contains(**f))
                .map(|f| format!("[{table}] {f}")),
        );
    }
    assert!(
        missing.is_empty(),
        "fields with no row in docs/configuration.md: {missing:?}"
    );
    assert!(
        stale.is_empty(),
        "rows of docs/configuration.md for fields the configuration does not read: {stale:?}"
    );
}

#[test]
fn every_backend_is_in_the_backend_row() {
    let (rows, _) = field_rows();
    let row = rows
        .iter()
        .find(|r| r.table == "store" && r.fields == ["backend"])
        .expect("a row for [store] backend");
    let named = code_spans(&row.meaning);
    for backend in backends() {
        assert!(
            named.contains(&format!("\"{backend}\"").as_str()),
            "the backend row of docs/configuration.md does not name {backend:?}: {}",
            row.meaning
        );
    }
}

/// The configurations a field of `table` is tried in, each valid without it.
fn bases(table: &str) -> Vec<String> {
    match table {
        "" => vec![UPSTREAM.to_string()],
        "upstreams" => vec![format!("{UPSTREAM}[upstreams.default]\n")],
        "store" => std::iter::once(format!("{UPSTREAM}[store]\n"))
            .chain(backends().iter().map(|b| backend_table(b)))
            .collect(),
        "admin" => vec![format!("{UPSTREAM}[admin]\n")],
        "telemetry" => vec![format!(
            "{UPSTREAM}[telemetry]\notlp_endpoint = \"http://127.0.0.1:4318\"\n"
        )],
        "defaults" => vec![format!("{UPSTREAM}[defaults]\n")],
        "tls" => {
            // A certificate and its key, kept for the whole run.
            static PAIR: std::sync::OnceLock<(TestCa, String, String)> = std::sync::OnceLock::new();
            let (_, cert, key) = PAIR.get_or_init(|| {
                let ca = TestCa::new();
                let pair = ca.server("gateway", &["127.0.0.1"], Validity::Now);
                (ca, pair.cert().to_string(), pair.key_path().to_string())
            });
            vec![format!(
                "{UPSTREAM}[tls]\ncert_file = {cert:?}\nkey_file = {key:?}\n"
            )]
        }
        other => panic!("[{other}] has a literal default: say here what a valid table of it is"),
    }
}

/// `base` with `line` added to its last table (at the top level: before the first table).
fn with_line(base: &str, table: &str, line: &str) -> String {
    match table {
        "" => format!("{line}\n{base}"),
        _ => format!("{base}{line}\n"),
    }
}

#[test]
fn every_documented_default_is_the_codes() {
    let (rows, _) = field_rows();
    let mut wrong = Vec::new();
    let mut checked = 0;
    // A default written as a value (`"24h"`, `409`, `["POST", "PATCH"]`) must be what the
    // configuration is without the field; one written in words ("required", "one per core")
    // is not a value to check.
    for row in rows.iter().filter(|r| r.default.starts_with('`')) {
        let value = code_spans(&row.default)[0];
        for field in &row.fields {
            let mut accepted = false;
            for base in bases(&row.table) {
                let without = Config::from_toml(&base).unwrap();
                let line = format!("{field} = {value}");
                // A field of another backend is refused in this store table: not its default.
                let Ok(with) = Config::from_toml(&with_line(&base, &row.table, &line)) else {
                    continue;
                };
                accepted = true;
                if format!("{with:?}") != format!("{without:?}") {
                    let table: Vec<&str> = base.lines().skip(1).collect();
                    wrong.push(format!("{line} (in {})", table.join("; ")));
                }
            }
            if !accepted {
                wrong.push(format!("[{}] {field} = {value}: refused", row.table));
            }
            checked += 1;
        }
    }
    assert!(checked > 50, "{checked} defaults checked");
    assert!(
        wrong.is_empty(),
        "docs/configuration.md gives defaults the code does not use:\n{}",
        wrong.join("\n")
    );
}

#[tokio::test]
async fn every_metric_family_has_its_row() {
    let encoded = crate::common::gateway::every_family_scraped().await;
    // `# TYPE name kind`; a counter's samples, which a query names, end in `_total`.
    let families: Vec<(String, &str)> = encoded
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| match kind {
            "counter" => (format!("{name}_total"), kind),
            _ => (name.to_string(), kind),
        })
        .collect();
    assert!(families.len() > 20, "{encoded}");
    let doc = page("docs/operating.md");
    let rows: Vec<(Vec<&str>, &str)> = section(&doc, "Metrics")
        .into_iter()
        .filter_map(row_cells)
        .filter(|cells| cells[0].contains("`idemgate_"))
        .map(|cells| (code_spans(cells[0]), cells[1].trim()))
        .collect();
    for (name, kind) in &families {
        let row = rows
            .iter()
            .find(|(names, _)| names.contains(&name.as_str()));
        let Some((_, documented)) = row else {
            panic!("{name} ({kind}) has no row under Metrics in docs/operating.md")
        };
        assert_eq!(documented, kind, "the type of {name} in docs/operating.md");
    }
    for (names, _) in &rows {
        for name in names {
            assert!(
                families.iter().any(|(n, _)| n == name),
                "docs/operating.md has a row for {name}, which the registry does not expose"
            );
        }
    }
}

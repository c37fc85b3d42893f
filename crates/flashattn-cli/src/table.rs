//! Plain-text tables with aligned columns.

/// Cells that stand for a missing number; they do not make a column textual.
const PLACEHOLDERS: [&str; 4] = ["", "-", "n/a", "skipped"];

/// A table: a header row and data rows of cells; text columns are left-aligned, numbers right.
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers.
    pub fn new(headers: &[&str]) -> Self {
        Table {
            headers: headers.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row (missing cells are blank, extra cells are dropped).
    pub fn push(&mut self, mut row: Vec<String>) {
        row.resize(self.headers.len(), String::new());
        self.rows.push(row);
    }

    /// The table as lines of text, columns separated by two spaces, a rule under the header.
    pub fn render(&self) -> String {
        let n = self.headers.len();
        let width = |c: usize| {
            self.rows
                .iter()
                .map(|r| r[c].chars().count())
                .chain([self.headers[c].chars().count()])
                .max()
                .unwrap_or(0)
        };
        let widths: Vec<usize> = (0..n).map(width).collect();
        let numeric: Vec<bool> = (0..n)
            .map(|c| {
                self.rows.iter().all(|r| {
                    r[c].starts_with(|ch: char| ch.is_ascii_digit())
                        || PLACEHOLDERS.contains(&r[c].as_str())
                })
            })
            .collect();
        let line = |cells: &[String]| {
            let parts: Vec<String> = cells
                .iter()
                .enumerate()
                .map(|(c, s)| {
                    if numeric[c] {
                        format!("{s:>w$}", w = widths[c])
                    } else {
                        format!("{s:<w$}", w = widths[c])
                    }
                })
                .collect();
            parts.join("  ").trim_end().to_string()
        };
        let mut out = line(&self.headers);
        out.push('\n');
        out.push_str(&"-".repeat(widths.iter().sum::<usize>() + 2 * (n.saturating_sub(1))));
        for r in &self.rows {
            out.push('\n');
            out.push_str(&line(r));
        }
        out.push('\n');
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_are_aligned() {
        let mut t = Table::new(&["name", "ms"]);
        t.push(vec!["flash".into(), "1.5".into()]);
        t.push(vec!["standard".into(), "12.25".into()]);
        let s = t.render();
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "name         ms");
        assert_eq!(lines[2], "flash       1.5");
        assert_eq!(lines[3], "standard  12.25");
    }
}

//! A table of strings that renders either as aligned plain text for the terminal or as a GitHub
//! markdown table, so both reports are built from the same rows.

/// Which side of its column a cell sticks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// A header plus rows; every row has one string per column.
#[derive(Debug, Clone, Default)]
pub struct Grid {
    columns: Vec<(String, Align)>,
    rows: Vec<Vec<String>>,
}

impl Grid {
    /// An empty grid with these columns.
    pub fn new(columns: Vec<(String, Align)>) -> Self {
        Self {
            columns,
            rows: Vec::new(),
        }
    }

    /// Appends a row, padded with empty cells or cut to the column count.
    pub fn push(&mut self, mut row: Vec<String>) {
        row.resize(self.columns.len(), String::new());
        self.rows.push(row);
    }

    /// Whether no row was pushed.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Aligned plain text, every line starting with `indent`, columns two spaces apart.
    pub fn to_text(&self, indent: &str) -> String {
        let widths = self.widths();
        let header: Vec<String> = self.columns.iter().map(|(h, _)| h.clone()).collect();
        let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
        let mut out = String::new();
        for row in [&header, &rule].into_iter().chain(&self.rows) {
            let cells: Vec<String> = row
                .iter()
                .zip(&self.columns)
                .zip(&widths)
                .map(|((cell, (_, align)), &width)| pad(cell, width, *align))
                .collect();
            out.push_str(indent);
            out.push_str(cells.join("  ").trim_end());
            out.push('\n');
        }
        out
    }

    /// A GitHub markdown table (pipes in cells are escaped).
    pub fn to_markdown(&self) -> String {
        let header: Vec<String> = self.columns.iter().map(|(h, _)| escape(h)).collect();
        let rule: Vec<String> = self
            .columns
            .iter()
            .map(|(_, align)| match align {
                Align::Left => ":---".to_string(),
                Align::Right => "---:".to_string(),
            })
            .collect();
        let mut out = markdown_row(&header);
        out.push_str(&markdown_row(&rule));
        for row in &self.rows {
            let cells: Vec<String> = row.iter().map(|c| escape(c)).collect();
            out.push_str(&markdown_row(&cells));
        }
        out
    }

    /// The widest cell of each column, header included, in characters.
    fn widths(&self) -> Vec<usize> {
        self.columns
            .iter()
            .enumerate()
            .map(|(i, (header, _))| {
                let cells = self.rows.iter().map(|r| r[i].chars().count());
                cells.fold(header.chars().count(), usize::max)
            })
            .collect()
    }
}

/// `cell` padded to `width` characters (not bytes: `µ` and `×` are one column each).
fn pad(cell: &str, width: usize, align: Align) -> String {
    let fill = " ".repeat(width.saturating_sub(cell.chars().count()));
    match align {
        Align::Left => format!("{cell}{fill}"),
        Align::Right => format!("{fill}{cell}"),
    }
}

fn markdown_row(cells: &[String]) -> String {
    format!("| {} |\n", cells.join(" | "))
}

fn escape(cell: &str) -> String {
    cell.replace('|', "\\|")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid() -> Grid {
        let mut g = Grid::new(vec![
            ("bs".to_string(), Align::Left),
            ("p50".to_string(), Align::Right),
        ]);
        g.push(vec!["4k".to_string(), "180µs".to_string()]);
        g.push(vec!["1m".to_string()]);
        g
    }

    #[test]
    fn text_aligns_by_characters() {
        let text = grid().to_text("");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "bs    p50");
        assert_eq!(lines[1], "--  -----");
        assert_eq!(lines[2], "4k  180µs");
        assert_eq!(lines[3], "1m");
    }

    #[test]
    fn markdown_has_alignment_row() {
        let md = grid().to_markdown();
        assert!(md.starts_with("| bs | p50 |\n| :--- | ---: |\n| 4k | 180µs |\n"));
    }
}

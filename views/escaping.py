"""Escaping user-supplied text (model and file names, run labels, reasons) for each channel
it is shown in: Streamlit and report Markdown, Plotly's pseudo-HTML (chart titles, trace
names, labels, hover text) and CSV cells opened in a spreadsheet. No Streamlit here: the
report and the pages share it.

Why each one is needed:
- Markdown: Streamlit renders captions, alerts, progress and expander labels as Markdown
  (GitHub-flavoured: bare URLs and e-mail addresses become links) plus its own directives
  (`:red[...]`, `:material/x:`, `$...$` LaTeX). Backslash-escaping the punctuation that
  opens markup, and breaking `www.`, `://` and `@`, leaves plain text.
- Plotly: every text a chart draws is parsed as pseudo-HTML (`<a href>`, `<b>`, `<br>`),
  even inside a page's or a report's own escaping, so text must reach Plotly with `&`, `<`
  and `>` as entities (Plotly decodes those and draws the characters). Quotes stay: no
  markup starts with one.
- SVG (the Plan page's charts, views.svg_charts): entities for markup characters and quotes,
  and one line, since the chart travels as a Markdown HTML block that a blank line would end.
- CSV: a spreadsheet runs a cell that starts with `=`, `+`, `-` or `@` as a formula (tab
  and carriage return are read as the same prefixes by some); a leading apostrophe keeps
  it text (OWASP "CSV injection"). A string that is a plain number is left as it is.
"""

from __future__ import annotations

import html
import re

# Punctuation that opens inline markup anywhere (links and images need `[`, so parentheses
# and `!` are safe once it is escaped); `:` only where it touches the next character
# (`://`, `:red[`, `:smile:`), and `.` only in `www.` (escaping every colon and dot would
# litter sentences and numbers with backslashes).
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]<>|~$@&])")
_TIGHT_COLON = re.compile(r":(?=\S)")
_WWW_DOT = re.compile(r"(?i)\b(www)\.")
# What opens a block when it starts the text: a heading, a list item, a rule ("---", "==="
# under a line); a number only as an ordered-list marker ("1. ", not "1.25 GiB").
_BLOCK_START = re.compile(r"^(\s*)([#+=-](?=[\s=-]|$)|\d{1,9}(?=[.)](?:\s|$)))")
_LINE_BREAKS = re.compile(r"[\r\n\u2028\u2029]+")
FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")


def markdown_text(value: object) -> str:
    """`value` as Markdown that renders as exactly its text, on one line."""
    text = _LINE_BREAKS.sub(" ", str(value))
    text = _MARKDOWN_SPECIAL.sub(r"\\\1", text)
    text = _TIGHT_COLON.sub(r"\\:", text)
    text = _WWW_DOT.sub(r"\1\\.", text)
    return _BLOCK_START.sub(_escape_block_start, text)


def _escape_block_start(match: re.Match) -> str:
    marker = match.group(2)
    if marker.isdigit():  # "1." opens an ordered list: escape the dot or parenthesis after it
        return match.group(1) + marker + "\\"
    return match.group(1) + "\\" + marker


def svg_text(value: object) -> str:
    """`value` as SVG character data or an attribute value (the Plan page's charts, which reach
    the page as a Markdown HTML block): markup characters as entities, line breaks as spaces (a
    blank line would end the HTML block and let the rest be read as Markdown)."""
    return html.escape(_LINE_BREAKS.sub(" ", str(value)), quote=True)


def plotly_text(value: object) -> str:
    """`value` as text Plotly draws literally (no pseudo-HTML tags)."""
    return html.escape(str(value), quote=False)


def csv_cell(value: object) -> object:
    """A string that a spreadsheet would run as a formula, made text; other values unchanged."""
    if not isinstance(value, str) or not value.startswith(FORMULA_PREFIXES):
        return value
    try:
        float(value)
    except ValueError:
        return "'" + value
    return value  # "-1.5" is a number, not a formula

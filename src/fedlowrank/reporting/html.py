"""One self-contained HTML page of a report: its markdown text rendered, its figures inline and the command that
made it, readable offline in any browser (no script, no style sheet or image fetched from anywhere).

:func:`html_page` renders the markdown that fedlowrank's reports write (``results.md``): ``#``/``##`` headings,
``- `` bullet lines, pipe tables (a header row, a ``|---|`` row, body rows), paragraphs, and inline ```code```;
everything else is text, escaped. Each figure is a PNG embedded as a ``data:`` URI with its caption.
"""

from __future__ import annotations

import base64
import html
import re

_STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:0.9em}th,td{border:1px solid #bbb;padding:0.25em 0.5em;
text-align:left}th{background:#eee}code,pre{font-family:ui-monospace,monospace;background:#f4f4f4}
pre{padding:0.6em;white-space:pre-wrap}figure{margin:1.5em 0}img{max-width:100%;border:1px solid #ddd}
figcaption{font-size:0.9em;color:#555}"""


def _inline(text: str) -> str:
    """Escaped ``text`` with ```code``` spans."""
    parts = re.split(r"`([^`]*)`", text)
    return "".join(f"<code>{html.escape(p)}</code>" if i % 2 else html.escape(p) for i, p in enumerate(parts))


def _cells(line: str) -> list[str]:
    """The cells of a pipe-table row (``\\|`` is a literal bar)."""
    inner = line.strip()[1:-1] if line.strip().endswith("|") else line.strip()[1:]
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]


def markdown_html(text: str) -> str:
    """The HTML of the markdown subset of the module docstring."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{_inline(line[level:].strip())}</h{level}>")
            i += 1
        elif line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(lines[i])
                i += 1
            head, body = rows[0], [r for r in rows[1:] if not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", r.strip())]
            out.append("<table><thead><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in _cells(head))
                       + "</tr></thead><tbody>" + "".join(
                           "<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in _cells(r)) + "</tr>" for r in body)
                       + "</tbody></table>")
        elif line.startswith("- "):
            items = []
            while i < len(lines) and lines[i].startswith("- "):
                items.append(lines[i][2:])
                i += 1
            out.append("<ul>" + "".join(f"<li>{_inline(item)}</li>" for item in items) + "</ul>")
        else:
            para = []
            while i < len(lines) and lines[i].strip() and not lines[i].startswith(("#", "|", "- ")):
                para.append(lines[i])
                i += 1
            out.append(f"<p>{_inline(' '.join(para))}</p>")
    return "\n".join(out)


def html_page(title: str, markdown: str, figures: list[tuple[str, bytes]], command: str) -> str:
    """The page: ``title``, the ``markdown`` rendered, each figure ``(caption, PNG bytes)`` inline, and
    ``command``, the exact command that made it."""
    images = "\n".join(f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,'
                       f'{base64.b64encode(png).decode()}"><figcaption>{html.escape(caption)}</figcaption></figure>'
                       for caption, png in figures)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_STYLE}</style></head><body>\n{markdown_html(markdown)}\n<h2>Figures</h2>\n{images}\n"
            f"<h2>Command</h2>\n<pre>{html.escape(command)}</pre>\n</body></html>\n")


__all__ = ["html_page", "markdown_html"]

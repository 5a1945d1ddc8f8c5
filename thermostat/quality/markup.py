"""HTML consistency: duplicate ids, references to ids that do not exist, unbalanced tags.

Generated pages degenerate in ways a reader notices only when the page breaks: a block pasted
twice (its ids now appear twice), a `<label for="email">` whose input came out as
`id="email-input"`, a closing tag that never came. Checked with the stdlib `html.parser`
(lenient: it never raises), only when the text contains at least one tag of a known HTML
element (so C++ `a<b>c` or prose mentioning "<tag>" is not mistaken for markup).

Definitions:
- id: the value of an `id` attribute; duplicate = an id carried by two or more elements.
- reference: `href="#x"` (not "#" or "#top", which the HTML spec resolves without an element;
  x as written or percent-decoded),
  the space-separated IDREF lists `for`, `list`, `form`, `headers`, `aria-labelledby`,
  `aria-describedby`, `aria-controls`, `aria-owns`, `aria-details`, `aria-errormessage`,
  `aria-flowto`, `aria-activedescendant`, and in scripts `getElementById("x")` /
  `querySelector("#x")`. Its target exists when an element has that id (or, for `href`, an
  `<a name>`), or a script assigns that id.
- unclosed: an element still open at the end, or closed implicitly by an outer end tag;
  void elements (br, img, input, ...) and elements whose end tag HTML lets you omit (p, li,
  td, ...) never count. stray: an end tag with no open element of that name.
- complete: the text holds a whole page, from an `<html>` start tag to an `</html>` or
  `</body>` end tag: nothing can still arrive to define a referenced id or close an element,
  and nothing came before that could have.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from html.parser import HTMLParser
from urllib.parse import unquote


def _names(words: str) -> frozenset[str]:
    return frozenset(words.split())


VOID = _names(
    "area base br col embed hr img input link meta param source track wbr "
    "basefont bgsound frame keygen command isindex"
)
OPTIONAL_END = _names(
    "html head body p li dt dd rt rp rb rtc optgroup option colgroup caption thead tbody "
    "tfoot tr td th"
)
ELEMENTS = _names(
    "a abbr address area article aside audio b base bdi bdo blockquote body br button canvas "
    "caption cite code col colgroup data datalist dd del details dfn dialog div dl dt em embed "
    "fieldset figcaption figure footer form h1 h2 h3 h4 h5 h6 head header hgroup hr html i "
    "iframe img input ins kbd label legend li link main map mark menu meta meter nav noscript "
    "object ol optgroup option output p param picture pre progress q rp rt ruby s samp script "
    "search section select slot small source span strong style sub summary sup svg table tbody "
    "td template textarea tfoot th thead time title tr track u ul var video wbr"
)
IDREF_LISTS = _names(
    "for list form headers aria-labelledby aria-describedby aria-controls aria-owns "
    "aria-details aria-errormessage aria-flowto aria-activedescendant"
)
_ELEMENT_ALTERNATIVES = "|".join(sorted(ELEMENTS, key=len, reverse=True))
_ATTRIBUTE = r"""\s+[^\s<>&|="'/]+(?:\s*=\s*(?:"[^"]*"|'[^']*'|[^\s"'<>]+))?"""
_TAG_RE = re.compile(  # a start or end tag of a known element, with well-formed attributes
    r"<(?:/?(?:" + _ELEMENT_ALTERNATIVES + r")(?:" + _ATTRIBUTE + r")*\s*/?|!doctype\s+html)>",
    re.I,
)
_SCRIPT_REF_RE = re.compile(
    r"""getElementById\(\s*(['"])([^'"\s]+)\1\s*\)|querySelector\(\s*(['"])#([\w-]+)\3\s*\)"""
)
_SCRIPT_ID_RE = re.compile(  # id="x" in markup strings (maybe escaped), el.id = "x", setAttribute
    r"""\bid\s*=\s*\\?['"]([^'"\\\s]+)|\.id\s*=\s*['"]([^'"\s]+)['"]"""
    r"""|setAttribute\(\s*['"]id['"]\s*,\s*['"]([^'"\s]+)['"]"""
)


def has_markup(text: str) -> bool:
    """True when `text` contains a tag of a known HTML element (or an HTML doctype)."""
    return _TAG_RE.search(text) is not None


@dataclass(frozen=True)
class MarkupReport:
    """What the HTML checks found; names in order of first appearance."""

    complete: bool
    duplicate_ids: tuple[str, ...]
    dangling_refs: tuple[tuple[str, str], ...]  # (missing id, attribute or script call)
    unclosed_tags: tuple[str, ...]  # one entry per unclosed element
    stray_end_tags: tuple[str, ...]  # one entry per stray end tag


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: Counter[str] = Counter()
        self.targets: set[str] = set()  # ids and <a name>s assigned anywhere
        self.refs: list[tuple[str, str]] = []
        self.stack: list[str] = []
        self.unclosed: list[str] = []
        self.stray: list[str] = []
        self.opened = False  # an <html> start tag was seen
        self.closed = False  # then an </html> or </body> end tag

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.opened = self.opened or tag == "html"
        self._attributes(tag, attrs)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._attributes(tag, attrs)  # <x/>: opened and closed at once

    def handle_endtag(self, tag: str) -> None:
        if tag in ("html", "body"):
            self.closed = self.opened
        if tag in VOID:
            return
        if tag not in self.stack:
            self.stray.append(tag)
            return
        while (top := self.stack.pop()) != tag:
            self._implicitly_closed(top)

    def handle_data(self, data: str) -> None:
        if self.stack and self.stack[-1] == "script":
            for m in _SCRIPT_REF_RE.finditer(data):
                self.refs.append((m.group(2) or m.group(4), "script"))
            for m in _SCRIPT_ID_RE.finditer(data):
                self.targets.add(next(g for g in m.groups() if g))

    def finish(self) -> None:
        self.close()
        while self.stack:
            self._implicitly_closed(self.stack.pop())

    def _implicitly_closed(self, tag: str) -> None:
        if tag not in OPTIONAL_END:
            self.unclosed.append(tag)

    def _attributes(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if not value:
                continue
            if name == "id" and value.strip():
                self.ids[value.strip()] += 1
                self.targets.add(value.strip())
            elif name == "name" and tag == "a":
                self.targets.add(value)
            elif name in ("href", "xlink:href") and value.startswith("#"):
                fragment = value[1:]
                if fragment and fragment.lower() != "top":
                    self.refs.append((fragment, name))
            elif name in IDREF_LISTS:
                self.refs.extend((ref, name) for ref in value.split())


def _resolves(ref: tuple[str, str], targets: set[str]) -> bool:
    """HTML's fragment rule: the fragment as written, else percent-decoded, names the target."""
    ident, attribute = ref
    if ident in targets:
        return True
    return attribute.endswith("href") and unquote(ident) in targets


def check_markup(text: str) -> MarkupReport | None:
    """The HTML checks of `text`, or None when it contains no HTML tags."""
    if not has_markup(text):
        return None
    c = _Collector()
    c.feed(text)
    c.finish()
    dangling = dict.fromkeys(ref for ref in c.refs if not _resolves(ref, c.targets))
    return MarkupReport(
        complete=c.closed,
        duplicate_ids=tuple(name for name, k in c.ids.items() if k > 1),
        dangling_refs=tuple(dangling),
        unclosed_tags=tuple(c.unclosed),
        stray_end_tags=tuple(c.stray),
    )

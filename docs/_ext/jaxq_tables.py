"""Tables generated at build time from jaxq's own data, so they cannot drift from the code.

``jaxq-annotations``
    Every annotation op in ``jaxq.annotate.registry()``: its function, support level, whether it
    is an identity on values, and its one-line summary.

``jaxq-backend-ops`` *backend ...*
    One row per primitive that some listed backend has a table for, one column per backend,
    from ``jaxq.partition.backend_ops``; a backend with no table (``"xla"``) runs every row.

Signatures also name JAX's type aliases (``jax.typing.ArrayLike``) instead of their expansion.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.typing
from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective
from sphinx.util.typing import stringify_annotation

import jaxq.annotate
import jaxq.partition


def _xref(target: str, text: str) -> nodes.Node:
    """A link to a documented Python function, as :func:`target` would make it."""
    ref = addnodes.pending_xref(
        "", refdomain="py", reftype="func", reftarget=target, refexplicit=True, refwarn=True
    )
    ref += nodes.literal(text, text, classes=["xref", "py", "py-func"])
    return ref


def _table(header: list[str], rows: list[list[Any]], widths: list[int]) -> nodes.table:
    table = nodes.table(classes=["jaxq-generated"])
    group = nodes.tgroup(cols=len(header))
    table += group
    for w in widths:
        group += nodes.colspec(colwidth=w)

    def row(cells: list[Any]) -> nodes.row:
        out = nodes.row()
        for cell in cells:
            entry = nodes.entry()
            node = cell if isinstance(cell, nodes.Node) else nodes.Text(str(cell))
            entry += nodes.paragraph("", "", node)
            out += entry
        return out

    head = nodes.thead()
    head += row([nodes.strong(h, h) for h in header])
    group += head
    body = nodes.tbody()
    for r in rows:
        body += row(r)
    group += body
    return table


class AnnotationsTable(SphinxDirective):
    """The ``jaxq-annotations`` directive."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        rows = []
        for op in jaxq.annotate.registry():
            identity = "yes" if op.primitive in jaxq.annotate.IDENTITY_ANNOTATIONS else "no"
            fn = _xref(f"jaxq.annotate.{op.name}", op.name)
            rows.append([fn, op.level, identity, op.summary])
        return [_table(["op", "level", "identity", "what it does"], rows, [18, 12, 10, 60])]


class BackendOpsTable(SphinxDirective):
    """The ``jaxq-backend-ops`` directive: its arguments are backend names."""

    required_arguments = 1
    optional_arguments = 16
    has_content = False

    def run(self) -> list[nodes.Node]:
        tables = {b: jaxq.partition.backend_ops(b) for b in self.arguments}
        names = sorted({op for ops in tables.values() if ops is not None for op in ops})
        if not names:
            raise self.error("jaxq-backend-ops: none of the backends has a table of primitives")

        def mark(ops: tuple[str, ...] | None, op: str) -> str:
            if ops is None:
                return "yes (any)"
            return "yes" if op in ops else ""

        rows: list[list[Any]] = [
            [nodes.literal(op, op), *(mark(tables[b], op) for b in self.arguments)] for op in names
        ]
        header = ["primitive", *(f'"{b}"' for b in self.arguments)]
        return [_table(header, rows, [30, *(14 for _ in self.arguments)])]


# longest first: ArrayLike's expansion contains jax.Array's
_ALIASES = [
    (jax.typing.ArrayLike, "jax.typing.ArrayLike"),
    (jax.typing.DTypeLike, "jax.typing.DTypeLike"),
    (jax.Array, "jax.Array"),
]


def _short_aliases(s: str | None) -> str | None:
    if s is None:
        return None
    for alias, name in _ALIASES:
        s = s.replace(stringify_annotation(alias, "smart"), f"~{name}")
        s = s.replace(stringify_annotation(alias, "fully-qualified-except-typing"), name)
    return s


def _process_signature(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, sig: str | None, ret: str | None
) -> tuple[str | None, str | None]:
    return _short_aliases(sig), _short_aliases(ret)


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("autodoc-process-signature", _process_signature)
    app.add_directive("jaxq-annotations", AnnotationsTable)
    app.add_directive("jaxq-backend-ops", BackendOpsTable)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}

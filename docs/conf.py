"""Sphinx configuration for jaxq's API reference.

Build (from the repository root, with the ``docs`` extra installed)::

    sphinx-build -W -q docs docs/_build

Pages are MyST Markdown (``docs/*.md``); API entries come from the docstrings (autodoc with
napoleon for the Google-style ``Args:`` sections). The tables of annotation ops and of the
primitives each backend runs are generated at build time by ``docs/_ext/jaxq_tables.py`` from
``jaxq.annotate.registry()`` and ``jaxq.partition.backend_ops``.
"""

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent / "_ext"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxq  # noqa: E402

project = "jaxq"
author = "the jaxq authors"
copyright = "the jaxq authors"  # noqa: A001
release = version = jaxq.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
    "jaxq_tables",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# `x` in a docstring is code, as in Markdown (docstrings mix `x` and ``x``).
default_role = "code"

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "alabaster"
html_title = f"jaxq {release}"
html_theme_options = {"description": "A compiler toolkit on JAX's jaxpr", "fixed_sidebar": True}
html_show_sourcelink = False

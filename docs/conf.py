"""Sphinx configuration: the guides (MyST Markdown) and the API reference, rendered from the docstrings.

    pip install -e ".[docs]"
    python -m sphinx -W --keep-going -b html docs docs/_build/html

`-W` makes every warning an error: a broken link or cross-reference, a name autodoc cannot import, a docstring
Sphinx cannot read. tests/test_api_docs.py runs this build.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "moe_jax"
author = "moe_jax contributors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Docstrings are plain prose with Google-style "Args:" / "Returns:" sections.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
# Types in the signature; a parameter's entry only where its docstring describes it (no type-only entries).
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
# Type annotations name JAX, NumPy and Optax types that this build does not link (no intersphinx: the build runs
# offline); unresolved annotation targets are not warnings unless nitpicky.
nitpicky = False

# Docstrings quote names in single backticks, as Markdown does: render them as code.
default_role = "code"
myst_heading_anchors = 3
html_theme = "alabaster"

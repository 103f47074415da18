"""Sphinx configuration of the lightning-mp-lstm documentation (Sphinx + MyST Markdown).

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # import the library from the checkout, installed or not

project = "lightning-mp-lstm"
author = "lightning-mp-lstm contributors"
copyright = "lightning-mp-lstm contributors"  # noqa: A001
release = version = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "examples", "records", "Thumbs.db", ".DS_Store", "awd_lstm_ptb_results.md"]

# MyST: ``{directive}`` fences, anchors for "page.md#section" links, $...$ left alone.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Google-style docstrings; "Attributes:" as :ivar: fields so dataclass fields are not documented twice.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Overridden Lightning hooks would otherwise show Lightning's own (reST-heavy) docstrings.
autodoc_inherit_docstrings = False
autodoc_default_options = {"members": True, "show-inheritance": True}

# PyTorch's documentation theme: a wide, responsive layout (tables and code blocks get the page's width, the
# sidebars fold away on narrow screens), and a search box.
html_theme = "pydata_sphinx_theme"
html_title = "lightning-mp-lstm"
html_static_path: list[str] = []
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
}
# The copy button leaves out a console prompt and the output lines after it.
copybutton_prompt_text = r"\$ "
copybutton_prompt_is_regexp = True

"""Sphinx configuration of the API reference (built from the docstrings).

Build: ``python -m sphinx -W --keep-going -b html docs/api docs/api/_build``."""

project = "attnpolicy"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.viewcode"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_mock_imports = ["vllm", "transformers"]
default_role = "code"
exclude_patterns = ["_build"]
html_theme = "alabaster"
suppress_warnings = ["ref.python"]  # a name re-exported in two modules resolves either way

"""``attnpolicy report``: the measurements a user needs, from one command.

:mod:`~attnpolicy.report.build` runs them (bench, sweep, validation) into
report.json, :mod:`~attnpolicy.report.markdown` renders report.md from that
JSON, :mod:`~attnpolicy.report.plots` draws the PNGs (also used by
``attnpolicy simulate --plot``). Importing the package loads none of them: ``plan``
and ``simulate`` use the Markdown and plots without loading what measures.
"""

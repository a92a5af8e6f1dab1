"""``attnpolicy report``: the measurements a user needs, from one command.

:mod:`~attnpolicy.report.build` runs them (bench, sweep, validation) into
report.json, :mod:`~attnpolicy.report.markdown` renders report.md from that
JSON, :mod:`~attnpolicy.report.plots` draws the PNGs (also used by
``attnpolicy simulate --plot``).
"""

from attnpolicy.report.build import ReportSettings, make_report

__all__ = ["ReportSettings", "make_report"]

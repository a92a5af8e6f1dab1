"""``attnpolicy report``: the measurements a user needs, from one command.

:mod:`~attnpolicy.measure.report.build` runs them (bench, sweep, validation) into
report.json, :mod:`~attnpolicy.measure.report.markdown` renders report.md from that
JSON, :mod:`~attnpolicy.measure.report.plots` draws the PNGs (also used by
``attnpolicy simulate --plot``).
"""

from attnpolicy.measure.report.build import ReportSettings, make_report

__all__ = ["ReportSettings", "make_report"]

"""The dispatcher and the rooms it delegates to.

- :mod:`~attnpolicy.dispatch.dispatcher`: :class:`Dispatcher`, the front door
  (``prepare(layout, spec)`` → :class:`Step`; ``attend`` = ``prepare(...).run(q, k, v)``);
- :mod:`~attnpolicy.dispatch.step`: :class:`Step` and :class:`HostStep`, a prepared batch;
- :mod:`~attnpolicy.dispatch.batch_plan`: the whole plan of one batch, in one call;
- :mod:`~attnpolicy.dispatch.graph_source`: any graph family's graphs from the cache, the
  store and the builder, strict mode (shared with the whole-model engine);
- :mod:`~attnpolicy.dispatch.background`: any family's background compiles, pad-up and switch-in;
- :mod:`~attnpolicy.dispatch.call_graphs`: the attention-call family, a batch's graphs fetched and pinned;
- :mod:`~attnpolicy.dispatch.switch`: switching to a re-planned config without a stall;
- :mod:`~attnpolicy.dispatch.stats`: typed counters and :class:`DispatcherStats`;
- :mod:`~attnpolicy.dispatch.memo`: the bounded memo every room uses.
"""

from attnpolicy.dispatch.call_graphs import Builder
from attnpolicy.dispatch.dispatcher import Dispatcher
from attnpolicy.dispatch.stats import DispatcherStats
from attnpolicy.dispatch.step import HostStep, Step

__all__ = ["Builder", "Dispatcher", "DispatcherStats", "HostStep", "Step"]

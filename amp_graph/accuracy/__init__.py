"""Accuracy tools: how far a mixed-precision graph is from float32, and which ops to demote.

* :mod:`~amp_graph.accuracy.shadow` - the graph and its float32 shadow run node by node;
* :mod:`~amp_graph.accuracy.float32_error` - :class:`OutputError`, outputs against float32;
* :mod:`~amp_graph.accuracy.autopolicy_search` - :func:`amp_graph.autopolicy`, the search for
  the ops to keep in float32.
"""

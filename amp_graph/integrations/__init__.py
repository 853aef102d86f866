"""Integrations with training frameworks.

* :mod:`~amp_graph.integrations.lightning` - :class:`AmpGraphPrecision`, a Lightning
  precision plugin (needs ``lightning``, imported only here).
"""

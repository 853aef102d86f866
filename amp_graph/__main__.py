"""``python -m amp_graph``: the ``amp-graph`` command."""

from amp_graph.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

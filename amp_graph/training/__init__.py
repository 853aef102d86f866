"""The training step: ``amp_graph.Graph`` and what its step graph calls.

* :mod:`~amp_graph.training.nn_graph` - :class:`Graph` (OneFlow's ``nn.Graph`` style), the
  facade users read; :mod:`~amp_graph.training.graph_config` - its ``config``
  (:class:`GraphConfig`);
* :mod:`~amp_graph.training.step_builder` - from the Graph's registrations to its step graphs:
  ``build`` captured through the front door, O2's masters, the step, the CUDA graph replayer;
* :mod:`~amp_graph.training.step_graph` - the step as one FX graph: forward, backward, loss
  scaling, check, optimizer step and scale update as nodes;
* :mod:`~amp_graph.training.step_ops` - the calls those nodes make;
* :mod:`~amp_graph.training.master_weights` - O2's float32 masters;
* :mod:`~amp_graph.training.fsdp_plan` - FSDP2 mixed-precision policies planned from the AMP
  plan, before sharding.
"""

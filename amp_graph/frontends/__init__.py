"""The front ends: ``amp_graph.compile`` and the ``torch.compile`` backend, over one request.

* :mod:`~amp_graph.frontends.compiler` - :func:`compile`, :class:`CompiledModule` and
  :func:`rewrite` (the passes run on a capture), which the backend and Graph share;
* :mod:`~amp_graph.frontends.dynamo_backend` - the ``backend="amp_graph"`` of ``torch.compile``;
* :mod:`~amp_graph.frontends.policy_request` - what every entry point does with the user's
  policy, dtype and model, so that all of them mean the same by it;
* :mod:`~amp_graph.frontends.cpu_low_kernels` - the ops the running CPU cannot compute low.
"""

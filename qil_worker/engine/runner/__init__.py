"""The model runner (``model_runner.ModelRunner``) and what it runs a step with: the step's
input tensors (``batch``), the decode and mixed-step CUDA graphs (``decode_graphs``,
``step_graphs``, their shapes in ``graph_buckets``, one capture pool in ``graph_capture``)."""

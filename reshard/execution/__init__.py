"""Planning and execution: turn a located checkpoint and the user's options into a validated
:class:`~reshard.core.plan_types.Plan` (:mod:`~reshard.execution.planner`), then write each target
(:mod:`~reshard.execution.engine`).

This package sits above the core (pure primitives), the model families and the formats, and asks
them; none of them imports it. A format that must index what it writes before writing it (the
Hugging Face header, the torch_dist index) gets each target's pending state dict through
:meth:`Plan.target_state <reshard.core.plan_types.Plan.target_state>`, which the planner wires to the
engine, so the layers point one way.
"""

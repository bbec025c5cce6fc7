"""Exact accumulation inside other frameworks' training loops.

``gradaccum.integrations.transformers.Trainer`` (extra ``gradaccum[transformers]``) and
``gradaccum.integrations.lightning.ExactAccumulation`` (extra ``gradaccum[lightning]``). Each
module imports its framework; ``import gradaccum`` imports neither. Both run the engine's
arithmetic (``FrameworkWindow``): backward on each micro-batch's summed loss, then one
division of the window's gradient by the window's global item count.
"""

"""Layer 1, the math: capability tracking, value functions, allocators, GRPO advantages and loss.

numpy / torch in, numpy / torch out: no I/O, no Prefect, no file paths.
"""

"""Reading a run: its tables, figures, text, report, plots and trackers; nothing here writes a stage
output (``coba_tasks.pipeline`` writes, and never imports a reader)."""

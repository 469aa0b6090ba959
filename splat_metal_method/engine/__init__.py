"""The training engine: the Trainer (exact resume, clean stop), NaN guard and atomic writes, memory hooks and budgets, several processes."""

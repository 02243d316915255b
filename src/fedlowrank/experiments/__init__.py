"""Experiments over many runs: ``compare`` (paired seeds), ``tune`` (validation split), their statistics and plots."""

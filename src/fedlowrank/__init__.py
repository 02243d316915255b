"""Federated fine-tuning in low-rank subspaces under non-IID data."""

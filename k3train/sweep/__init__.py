"""Ablation sweeps: the variants of an ablation file run one after another (runner) and tabulated (results)."""

"""Hugging Face format: ``export-hf`` (export.py) and ``import`` / ``load_hf`` (load.py);
the tensor-name map both use is names.py (documented in docs/hf_format.md)."""

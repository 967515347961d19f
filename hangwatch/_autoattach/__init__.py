"""Directory `hangwatch run` puts first on PYTHONPATH: its `sitecustomize` attaches the hook."""

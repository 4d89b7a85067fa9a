"""Integrations with training frameworks (application layer: may import ``datapipes``): ``lightning.py``."""

"""Persistent per-(model, agent) KV state: on-disk format, store, background writer."""

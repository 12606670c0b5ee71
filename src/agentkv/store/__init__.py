"""Persistent per-(model, agent) KV state: the files (store version 3), the store, the background
writer."""

"""Persistent per-(model, agent) KV state: the files (store version 2), the store, the background
writer."""

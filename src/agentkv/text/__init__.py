"""Agent text: token spans and text-level prefix matching."""

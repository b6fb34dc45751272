"""Megatron-core training backend (imported only by the Megatron engine; never by `import tandemrl`)."""

"""Targets (hub id, local dir, packaged GGUF) and the DFlash drafter."""

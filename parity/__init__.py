"""Token parity of vkengine against llama.cpp: `parity run`, `parity report`,
`parity serve-reference` (see README and shared/notes/parity.md)."""

# The two entry points of README.md; each sets everything up first (idempotent).
.PHONY: setup serve test gpu-test

setup:
	@scripts/setup.sh

serve: setup
	.venv/bin/vkengine serve

test: setup
	.venv/bin/ruff check .
	.venv/bin/mypy
	.venv/bin/python -m pytest -q

gpu-test:
	tests/gpu/run_on_gpu.sh

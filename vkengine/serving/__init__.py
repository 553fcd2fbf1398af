"""Running requests on an engine: the scheduler (scheduler.py, pure Python),
the runner's pipeline (runner.py: schedule -> run -> postprocess), output
rules (output.py), host sampling (sampling.py), one-sequence generation
(generate.py) and speculative decoding with a model's MTP block (mtp.py)."""

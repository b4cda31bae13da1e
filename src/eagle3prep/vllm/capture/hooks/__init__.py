"""The hooks capture path: forward hooks on the decoder layers inside vLLM's workers, reading which rows of a step
belong to which request from vLLM's V1 model runner (gone since vLLM 0.34). path.py is the driver's half,
worker.py the worker extension, internals.py every runner and model internal they read, each checked.
Nothing outside this package imports it but capture/backend.py: it goes as a unit with its last vLLM."""

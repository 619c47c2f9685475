"""The memory study: the longest context per GPU, ``python -m studies.memory`` (``longest_context.py``: one
training step per memory saver and length, its true peak per term, the longest length under a cap, the
tables), on the peak-memory meter (``peak.py``: the profiler's allocation events replayed in order) and
projected to Llama-3-8B and -70B on 80 GB GPUs (``projection.py``)."""
